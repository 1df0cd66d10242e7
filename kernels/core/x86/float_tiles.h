// The tiles of one x86 instruction set that multiply f32 activations: the exact mode's (--inference-precision
// f32: each quantized block's weights dequantized to floats, w = s c + o, against the activations unquantized) and
// the float weights' (F16, BF16, F32). Included by driver.h; a tile is R weight rows x MB activation rows, and
// every output sees the same float operations in the same order whatever R and MB are.

template <class F, int R, int MB>
static inline void tile_exact(const Product& p, int64_t n, int64_t m) {
    const int64_t groups = p.K / 32;
    const uint8_t* rows[R];
    tile_rows(p, n, rows);
    const float* x[MB];
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i) x[i] = p.a->x_row(m + i);
    __m256 acc[R][MB];
    zero_sums(acc);
    const TilePrefetch<R> prefetch(p, n, rows[0] + R * p.row_bytes);
    constexpr size_t kSpanBytes = size_t(R) * (256 / F::QK) * F::BYTES;
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
        const int span = int(std::min<int64_t>(8, groups - g0));
        prefetch(kSpanBytes, g0 / 8);
        FLEET_UNROLL
        for (int r = 0; r < R; ++r) {
            Span<F> sp;
            sp.read(span_block<F>(rows[r], g0), span);
            for (int j = 0; j < span; ++j) {
                int sub;
                const uint8_t* blk = sub_block<F>(rows[r], g0, j, sub);
                const __m256i c = F::codes(blk, sub);
                const int64_t k0 = (g0 + j) * 32;
                for (int part = 0; part < 4; ++part) {
                    const __m128i bytes = part < 2 ? _mm256_castsi256_si128(c) : _mm256_extracti128_si256(c, 1);
                    const __m128i eight = (part % 2) ? _mm_srli_si128(bytes, 8) : bytes;
                    const __m256i ints = F::SIGNED ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
                    const float s = part < 2 ? sp.s0[j] : sp.s1[j], o = part < 2 ? sp.o0[j] : sp.o1[j];
                    const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(s), _mm256_set1_ps(o));
                    FLEET_UNROLL
                    for (int i = 0; i < MB; ++i)
                        acc[r][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[i] + k0 + 8 * part), acc[r][i]);
                }
            }
        }
    }
    FLEET_UNROLL
    for (int r = 0; r < R; ++r)
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) p.y[(m + i) * p.ldy + n + r] = hsum(acc[r][i]);
}

// Float weights: 8 at a time into one accumulator, then the tail of K % 8 in order.
template <BlockType T>
static inline __m256 float8(const uint8_t* p) {
    if constexpr (T == BlockType::F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (T == BlockType::F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// kGathered: Product::rows (one instantiation each: the gathered prefetch's registers in this loop of a few
// instructions made F16 at 64 rows 1.2x slower for contiguous rows too).
template <BlockType T, int R, int MB, bool kGathered>
static inline void tile_float_rows(const Product& p, int64_t n, int64_t m) {
    constexpr int W = T == BlockType::F32 ? 4 : 2;  // bytes a weight
    const Format& f = *p.fmt;
    const int64_t k8 = p.K / 8 * 8;
    __m256 acc[R][MB];
    zero_sums(acc);
    const uint8_t* rows[R];
    tile_rows(p, n, rows);
    const TilePrefetch<R> prefetch(p, n, rows[0] + R * p.row_bytes);
    for (int64_t k = 0; k < k8; k += 8) {
        if constexpr (kGathered)
            prefetch(R * 8 * W, k / 8);
        else
            prefetch_next(rows[0] + R * p.row_bytes, R * 8 * W, k / 8);
        FLEET_UNROLL
        for (int r = 0; r < R; ++r) {
            const __m256 w = float8<T>(rows[r] + k * W);
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(p.a->x_row(m + i) + k), acc[r][i]);
        }
    }
    FLEET_UNROLL
    for (int r = 0; r < R; ++r) {
        const uint8_t* row = rows[r];
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) {
            float y = hsum(acc[r][i]);
            const float* x = p.a->x_row(m + i);
            for (int64_t k = k8; k < p.K; ++k) y = std::fma(float_weight(f, row, k), x[k], y);
            p.y[(m + i) * p.ldy + n + r] = y;
        }
    }
}

template <BlockType T, int R, int MB>
static inline void tile_float(const Product& p, int64_t n, int64_t m) {
    if (p.rows != nullptr) return tile_float_rows<T, R, MB, true>(p, n, m);
    tile_float_rows<T, R, MB, false>(p, n, m);
}
