// The row-tile kernels of one x86 instruction set, built from unpack.h. Included by isa_*.cpp with
// FLEET_DPBUSD(acc, u8, s8) defined (VNNI's vpdpbusd, or its exact AVX2 emulation) inside a namespace.
//
// A tile is R weight rows x MB activation rows with one accumulator per pair. Every accumulator sees the
// same instructions in the same order whatever R and MB are (tiles only share loads), so y[m, n] does not
// depend on the batch, the tiling or the thread split. Sub-block g of row n against activation row m adds
//   acc += float(dot(c, q)) * (s d)      (8 lanes; per-16 scales: lanes 0-3 and 4-7 take their half's)
//   corr += o0 dsum0 + o1 dsum1          (symmetric types: no corr)
// and y = hsum(acc) + corr.

constexpr int kPrefetchBytes = 768;  // software prefetch distance along each weight row (see docs/design.md)
constexpr int64_t kRowChunk = 64;    // activation rows per pass over a tile (keeps them in L2)

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

template <class F, int R, int MB>
static inline void tile_quantized(const Product& p, int64_t n, int64_t m) {
    constexpr int HALVES = F::QK / 16;
    const Activations& a = *p.a;
    const int64_t blocks = p.K / F::QK;
    const uint8_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = p.w + (n + r) * p.row_bytes;
    __m256 acc[R][MB];
    float corr[R][MB];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i) { acc[r][i] = _mm256_setzero_ps(); corr[r][i] = 0.0f; }
    for (int64_t b = 0; b < blocks; ++b) {
        float s[R][HALVES], o[R][HALVES];
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = rows[r] + b * F::BYTES;
            _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes), _MM_HINT_T0);
            F::scales(blk, s[r], o[r]);
        }
        for (int sub = 0; sub < F::SUBS; ++sub) {
            const int64_t g = b * F::SUBS + sub;
            __m256i q[MB];
            float d[MB], ds0[MB], ds1[MB];
            for (int i = 0; i < MB; ++i) {
                q[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q_row(m + i) + g * 32));
                d[i] = a.d_row(m + i)[g];
                ds0[i] = a.dsum_row(m + i)[2 * g];
                ds1[i] = a.dsum_row(m + i)[2 * g + 1];
            }
            for (int r = 0; r < R; ++r) {
                const __m256i c = F::codes(rows[r] + b * F::BYTES, sub);
                const __m256i u = F::SIGNED ? _mm256_abs_epi8(c) : c;
                const float s0 = s[r][2 * sub], s1 = s[r][2 * sub + 1];
                for (int i = 0; i < MB; ++i) {
                    const __m256i v = F::SIGNED ? _mm256_sign_epi8(q[i], c) : q[i];
                    const __m256i dot = FLEET_DPBUSD(_mm256_setzero_si256(), u, v);
                    const __m256 scale = F::PER16 ? _mm256_set_m128(_mm_set1_ps(s1 * d[i]), _mm_set1_ps(s0 * d[i]))
                                                  : _mm256_set1_ps(s0 * d[i]);
                    acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r][i]);
                    if (!F::SIGNED) corr[r][i] += o[r][2 * sub] * ds0[i] + o[r][2 * sub + 1] * ds1[i];
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i) p.y[(m + i) * p.ldy + n + r] = hsum(acc[r][i]) + corr[r][i];
}

template <class F, int R, int MB>
static inline void tile_exact(const Product& p, int64_t n, int64_t m) {
    constexpr int HALVES = F::QK / 16;
    const int64_t blocks = p.K / F::QK;
    const uint8_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = p.w + (n + r) * p.row_bytes;
    __m256 acc[R][MB];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        float s[R][HALVES], o[R][HALVES];
        for (int r = 0; r < R; ++r) {
            _mm_prefetch(reinterpret_cast<const char*>(rows[r] + b * F::BYTES + kPrefetchBytes), _MM_HINT_T0);
            F::scales(rows[r] + b * F::BYTES, s[r], o[r]);
        }
        for (int sub = 0; sub < F::SUBS; ++sub) {
            const int64_t k0 = (b * F::SUBS + sub) * 32;
            for (int r = 0; r < R; ++r) {
                const __m256i c = F::codes(rows[r] + b * F::BYTES, sub);
                for (int part = 0; part < 4; ++part) {
                    const __m128i bytes = part < 2 ? _mm256_castsi256_si128(c) : _mm256_extracti128_si256(c, 1);
                    const __m128i eight = (part % 2) ? _mm_srli_si128(bytes, 8) : bytes;
                    const __m256i ints = F::SIGNED ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
                    const int half = 2 * sub + part / 2;
                    const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(s[r][half]),
                                                     _mm256_set1_ps(o[r][half]));
                    for (int i = 0; i < MB; ++i)
                        acc[r][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(p.a->x_row(m + i) + k0 + 8 * part), acc[r][i]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r)
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

template <BlockType T, int R, int MB>
static inline void tile_float(const Product& p, int64_t n, int64_t m) {
    constexpr int W = T == BlockType::F32 ? 4 : 2;  // bytes a weight
    const Format& f = *p.fmt;
    const int64_t k8 = p.K / 8 * 8;
    __m256 acc[R][MB];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k8; k += 8) {
        for (int r = 0; r < R; ++r) {
            const uint8_t* at = p.w + (n + r) * p.row_bytes + k * W;
            _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchBytes), _MM_HINT_T0);
            const __m256 w = float8<T>(at);
            for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(p.a->x_row(m + i) + k), acc[r][i]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const uint8_t* row = p.w + (n + r) * p.row_bytes;
        for (int i = 0; i < MB; ++i) {
            float y = hsum(acc[r][i]);
            const float* x = p.a->x_row(m + i);
            for (int64_t k = k8; k < p.K; ++k) {
                float wk;
                if constexpr (T == BlockType::F32) __builtin_memcpy(&wk, row + 4 * k, 4);
                else if constexpr (T == BlockType::F16) wk = f16_to_f32(uint16_t(row[2 * k] | (row[2 * k + 1] << 8)));
                else wk = bf16_to_f32(uint16_t(row[2 * k] | (row[2 * k + 1] << 8)));
                y = std::fma(wk, x[k], y);
            }
            p.y[(m + i) * p.ldy + n + r] = y;
        }
    }
    (void)f;
}

// Columns [n0, n1) for every activation row: tiles of 4 weight rows x 2 activation rows, then the edges.
template <class Tile4x2, class Tile4x1, class Tile1x2, class Tile1x1>
static inline void sweep(const Product& p, int64_t n0, int64_t n1, Tile4x2 t42, Tile4x1 t41, Tile1x2 t12, Tile1x1 t11) {
    for (int64_t m0 = 0; m0 < p.M; m0 += kRowChunk) {
        const int64_t m1 = std::min(p.M, m0 + kRowChunk);
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) {
            int64_t m = m0;
            for (; m + 2 <= m1; m += 2) t42(p, n, m);
            if (m < m1) t41(p, n, m);
        }
        for (; n < n1; ++n) {
            int64_t m = m0;
            for (; m + 2 <= m1; m += 2) t12(p, n, m);
            if (m < m1) t11(p, n, m);
        }
    }
}

template <class F>
static void rows_quantized(const Product& p, int64_t n0, int64_t n1) {
    sweep(p, n0, n1, tile_quantized<F, 4, 2>, tile_quantized<F, 4, 1>, tile_quantized<F, 1, 2>, tile_quantized<F, 1, 1>);
}
template <class F>
static void rows_exact(const Product& p, int64_t n0, int64_t n1) {
    sweep(p, n0, n1, tile_exact<F, 4, 2>, tile_exact<F, 4, 1>, tile_exact<F, 1, 2>, tile_exact<F, 1, 1>);
}
template <BlockType T>
static void rows_float(const Product& p, int64_t n0, int64_t n1) {
    sweep(p, n0, n1, tile_float<T, 4, 2>, tile_float<T, 4, 1>, tile_float<T, 1, 2>, tile_float<T, 1, 1>);
}

static KernelTable make_table(const char* isa) {
    KernelTable t{isa, {}, {}};
#define FLEET_INTEGER(T) t.quantized[int(BlockType::T)] = rows_quantized<F##T>; t.exact[int(BlockType::T)] = rows_exact<F##T>;
    FLEET_INTEGER(Q4_0) FLEET_INTEGER(Q4_1) FLEET_INTEGER(Q5_0) FLEET_INTEGER(Q5_1) FLEET_INTEGER(Q8_0)
    FLEET_INTEGER(IQ4_NL) FLEET_INTEGER(MXFP4) FLEET_INTEGER(Q2_K) FLEET_INTEGER(Q3_K) FLEET_INTEGER(Q4_K)
    FLEET_INTEGER(Q5_K) FLEET_INTEGER(Q6_K) FLEET_INTEGER(IQ4_XS)
#undef FLEET_INTEGER
#define FLEET_FLOAT(T) t.quantized[int(BlockType::T)] = t.exact[int(BlockType::T)] = rows_float<BlockType::T>;
    FLEET_FLOAT(F32) FLEET_FLOAT(F16) FLEET_FLOAT(BF16)
#undef FLEET_FLOAT
    return t;
}
