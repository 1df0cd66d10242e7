// The column tile of Q4_K, Q5_K and Q6_K (prefill.h tile_columns) on 512-bit registers: AVX-512 VNNI only, included
// by isa_avx512vnni.cpp (FLEET_COLUMNS_512). The unpacked tile is prefill.h's UnpackedColumns, whose rows of
// kTileColumns = 16 columns (codes, scales, pairs, d, dmin) are each one 64-byte register here: a lane is still an
// output column, and each lane sees tile_columns' integer and float operations in its order, so the results are the
// same bits as the 256-bit tile's and the decode tiles'. Half the instructions for the same products: on a CPU with
// two 512-bit VNNI ports (Intel's server cores) the tile's vpdpbusd run twice as wide; on one that splits a 512-bit
// operation in two (Zen 4) it costs the same as the 256-bit tile.
static_assert(kTileColumns == 16, "a 512-bit register holds the tile's 16 columns");

constexpr int kColumns512MB = 8;  // activation rows a pass: 16 integer sums and 8 partial sums in registers

static inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
// vcvtdq2ps and vpslld written in their merge-masked forms with every lane kept: the same instruction, without GCC
// 12's false "may be used uninitialized" of the unmasked intrinsics' _mm512_undefined_* operand.
static inline __m512 to_float512(__m512i v) { return _mm512_mask_cvtepi32_ps(_mm512_setzero_ps(), 0xFFFF, v); }
template <int N>
static inline __m512i shift_left512(__m512i v) { return _mm512_mask_slli_epi32(_mm512_setzero_si512(), 0xFFFF, v, N); }
static inline __m512i broadcast512(const void* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// Sub-block j of block b (columns_sub_block's integer operations, 16 columns a register).
template <class F, int MB>
__attribute__((always_inline)) static inline void columns512_sub_block(const ColumnsView& t, const int8_t* const* q,
                                                                       int64_t b, int j, __m512i (&sum)[2][MB]) {
    constexpr int kChunk = F::CODE_BITS == 5 ? 2 : 4;  // as columns_sub_block's
    FLEET_UNROLL
    for (int h = 0; h < 2; ++h) {
        const __m512i scale = load512(t.scales + (b * 16 + 2 * j + h) * kTileColumns);
        FLEET_UNROLL
        for (int q0 = 4 * h; q0 < 4 * h + 4; q0 += kChunk) {
            __m512i part[MB];
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) part[i] = _mm512_setzero_si512();
            FLEET_UNROLL
            for (int quad = q0; quad < q0 + kChunk; ++quad) {
                const __m512i u = load512(t.codes + ((b * 8 + j) * 8 + quad) * 64);
                FLEET_UNROLL
                for (int i = 0; i < MB; ++i)
                    part[i] = _mm512_dpbusd_epi32(part[i], u, broadcast512(q[i] + b * 256 + j * 32 + 4 * quad));
            }
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) {
                if constexpr (F::CODE_BITS <= 5)
                    sum[h][i] = _mm512_dpwssd_epi32(sum[h][i], part[i], scale);
                else
                    sum[h][i] = _mm512_add_epi32(sum[h][i], _mm512_mullo_epi32(part[i], scale));
            }
        }
    }
}

template <class F, int MB>
static inline void tile_columns512(const Product& p, const ColumnsView& t, int64_t n, int columns, int64_t m) {
    const SuperRows<MB> act(*p.a, m);
    alignas(64) float acc[2][MB][16];  // in memory, touched once a block: the integer sums take the registers
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i) _mm512_store_ps(acc[0][i], _mm512_setzero_ps()), _mm512_store_ps(acc[1][i], _mm512_setzero_ps());
    for (int64_t b = 0; b < t.blocks; ++b) {
        __m512i sum[2][MB];
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) sum[0][i] = sum[1][i] = _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j) columns512_sub_block<F, MB>(t, act.q, b, j, sum);
        const __m512 d = _mm512_loadu_ps(t.d + b * kTileColumns);
        const __m512 dmin = _mm512_loadu_ps(t.dmin + b * kTileColumns);
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) {
            const __m512 x = _mm512_set1_ps(act.d[i][b]);
            FLEET_UNROLL
            for (int h = 0; h < 2; ++h) {
                __m512i psum = _mm512_setzero_si512();  // the minimums' M_h, or the zero point's sum
                FLEET_UNROLL
                for (int pair = 0; pair < 4; ++pair)
                    psum = _mm512_dpwssd_epi32(psum, load512(t.pairs + ((b * 2 + h) * 4 + pair) * kTileColumns),
                                               broadcast512(act.bsums[i] + b * 16 + 8 * h + 2 * pair));
                if constexpr (F::ZSHIFT >= 0) {
                    const __m512i is = _mm512_sub_epi32(sum[h][i], shift_left512<std::max(F::ZSHIFT, 0)>(psum));
                    _mm512_store_ps(acc[h][i], _mm512_fmadd_ps(to_float512(is), _mm512_mul_ps(d, x), _mm512_load_ps(acc[h][i])));
                } else {
                    __m512 a = _mm512_fmadd_ps(to_float512(sum[h][i]), _mm512_mul_ps(d, x), _mm512_load_ps(acc[h][i]));
                    _mm512_store_ps(acc[h][i], _mm512_fmadd_ps(to_float512(psum), _mm512_mul_ps(dmin, x), a));
                }
            }
        }
    }
    const __mmask16 keep = __mmask16((1u << columns) - 1u);  // columns <= 16
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i)
        _mm512_mask_storeu_ps(p.y + (m + i) * p.ldy + n, keep,
                              _mm512_add_ps(_mm512_load_ps(acc[0][i]), _mm512_load_ps(acc[1][i])));
}
