// Activations quantized in 256-bit registers (activations.h): the arithmetic of activations.cpp's scalar
// quantize_rows step for step (max|x| exact, id = 127 / max|x| in f32, rint(x id) to nearest even, clamped to
// [-127, 127]; d = max|x| / 127, rounded to f16 for groups of 32: group32_scale), so every instruction set gives
// the same bits as the scalar path (a test checks it). Included by driver.h inside one instruction set's namespace.

static inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

// 32 values x * id rounded and clamped, as int8 in order.
static inline __m256i quantize32(const float* x, __m256 id) {
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i v[4];
    for (int k = 0; k < 4; ++k) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), id),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v[k] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    }
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// q and d of `n` values (a multiple of 32) of x; the sums of each 4 q as int32 into sums4[n / 4].
static inline float quantize_group_simd(const float* x, int n, int8_t* q, int32_t* sums4) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    const float a = hmax(amax);
    const __m256 id = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
    for (int j = 0; j < n; j += 32) {
        const __m256i v = quantize32(x + j, id);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), v);
        const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(mask8(1), v), _mm256_set1_epi16(1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums4 + j / 4), s4);
    }
    return a / 127.0f;
}

static void quantize_rows_simd(Activations& a, int64_t r0, int64_t r1) {
    alignas(32) int32_t sums4[64];
    for (int64_t m = r0; m < r1; ++m) {
        const float* x = a.x_row(m);
        int8_t* q = a.q.data() + m * a.cols;
        if (a.group == 256) {
            float* d = a.d.data() + m * (a.cols / 256);
            int16_t* bsums = a.bsums.data() + m * (a.cols / 16);
            for (int64_t b = 0; b < a.cols / 256; ++b) {
                d[b] = quantize_group_simd(x + b * 256, 256, q + b * 256, sums4);
                for (int g = 0; g < 16; ++g)
                    bsums[b * 16 + bsum_slot(g)] = int16_t(sums4[4 * g] + sums4[4 * g + 1] + sums4[4 * g + 2] + sums4[4 * g + 3]);
            }
            continue;
        }
        const int64_t groups = a.cols / 32;
        float* d = a.d.data() + m * groups;
        float* dsum0 = a.dsum.data() + 2 * m * groups;
        float* dsum1 = dsum0 + groups;
        int32_t* lanes = a.lanes.data() + m * groups * 8;
        int32_t* gsum = a.gsum.data() + m * groups * 2;
        for (int64_t g = 0; g < groups; ++g) {
            d[g] = group32_scale(quantize_group_simd(x + g * 32, 32, q + g * 32, sums4));
            const __m256i s4 = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums4));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes + g * 8), _mm256_sub_epi32(_mm256_setzero_si256(), s4));
            const int32_t half0 = sums4[0] + sums4[1] + sums4[2] + sums4[3], half1 = sums4[4] + sums4[5] + sums4[6] + sums4[7];
            gsum[2 * g] = -half0;
            gsum[2 * g + 1] = -half1;
            dsum0[g] = d[g] * float(half0);
            dsum1[g] = d[g] * float(half1);
        }
    }
}
