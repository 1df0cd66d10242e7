// The prefill tiles of one x86 instruction set (many activation rows: a verify, a batch group, a prefill
// chunk). Included by driver.h after the decode tiles, whose integer and float operations these repeat in
// the same order (tile_quantized, block_sums, block_end).

// ---- many activation rows (a verify, a batch group, a prefill chunk), the 32-weight types: a tile of 8 x kPrefillNT
// weight rows is unpacked once, each sub-block's codes transposed so that a register holds 4 consecutive codes of
// 8 weight rows (llama.cpp repacks its Q4_0 in memory the same way for its prefill; fleet unpacks a tile at a time,
// the GGUF's bytes untouched). Then every activation row meets it: vpdpbusd of a register of codes against 4 of
// the row's values broadcast adds 4 products to each of 8 outputs, so a lane is an output column and the dot D of
// each half of a sub-block ends whole in its lane; the float operations on them are tile_quantized's, in its
// order: the same bits.
// Signed codes are kept as c + 128 (kOffsetCodes: VNNI only, so AVX2 keeps tile_quantized for those types).
constexpr int kPrefillRows = 4;  // at and above this many activation rows
constexpr int kPrefillMB = 4;    // activation rows a pass
constexpr int kPrefillNT = FLEET_WIDE_REGISTERS ? 2 : 1;  // registers of 8 output columns a pass (accumulators)
constexpr int kTileColumns = 8 * kPrefillNT;

// An unpacked tile by plain pointers: the kernels must not touch the thread_local holding it (each access
// to a thread_local of a shared library is a call, which spilled every accumulator).
struct TileView {
    int64_t groups;
    const uint8_t* codes;  // [groups][8 quads][kPrefillNT][8 columns][4 codes]
    const float *s, *o;    // [groups][kTileColumns]: each column's sub-block scale and offset
};

// 8 registers of 8 int32 each, transposed: v[r] lane t becomes v[t] lane r.
static inline void transpose8x8(__m256i (&v)[8]) {
    __m256i a[8], b[8];
    FLEET_UNROLL
    for (int k = 0; k < 4; ++k) {
        a[2 * k] = _mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]);
        a[2 * k + 1] = _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
    }
    FLEET_UNROLL
    for (int k = 0; k < 2; ++k) {
        b[4 * k] = _mm256_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 1] = _mm256_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
        b[4 * k + 2] = _mm256_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm256_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
    FLEET_UNROLL
    for (int t = 0; t < 4; ++t) {
        v[t] = _mm256_permute2x128_si256(b[t], b[t + 4], 0x20);
        v[t + 4] = _mm256_permute2x128_si256(b[t], b[t + 4], 0x31);
    }
}

// y[m, n .. n + min(8, columns) - 1] from the 8 lanes of v (an output column a lane).
static inline void store_columns(const Product& p, __m256 v, int64_t m, int64_t n, int columns) {
    alignas(32) float out[8];
    _mm256_store_ps(out, v);
    for (int k = 0; k < 8 && k < columns; ++k) p.y[m * p.ldy + n + k] = out[k];
}

// Activation rows a pass over an unpacked tile: as many as fit kTileActivationBytes of int8 values (each tile is
// unpacked once a pass), at least kRowChunk.
constexpr int64_t kTileActivationBytes = 512 * 1024;
static inline int64_t tile_row_chunk(int64_t K) { return std::max(kRowChunk, kTileActivationBytes / K / kRowChunk * kRowChunk); }

// Columns [n0, n1) over many activation rows: each tile of Width weight rows unpacked once (`tile`), then met by MB
// activation rows at a time (`wide`) and the rest one by one (`one`), tile_row_chunk(K) rows a pass.
template <int Width, int MB, class Tile, class Wide, class One>
static inline void sweep_tiles(const Product& p, int64_t n0, int64_t n1, Tile* tile, Wide wide, One one) {
    const int64_t chunk = tile_row_chunk(p.K);
    for (int64_t m0 = 0; m0 < p.M; m0 += chunk) {
        const int64_t m1 = std::min(p.M, m0 + chunk);
        for (int64_t n = n0; n < n1; n += Width) {
            const int columns = int(std::min<int64_t>(Width, n1 - n));
            tile->unpack(p, n, columns);
            const auto view = tile->view();
            int64_t m = m0;
            for (; m + MB <= m1; m += MB) wide(p, view, n, columns, m);
            for (; m < m1; ++m) one(p, view, n, columns, m);
        }
    }
}

template <class F>
struct UnpackedTile {
    static_assert(F::QK == 32 && !F::PER16 && (FLEET_VNNI || !F::SIGNED), "see tile_quantized, kOffsetCodes");
    int64_t groups = 0;
    std::vector<uint8_t> codes;
    std::vector<float> s, o;

    // Weight rows n .. n + columns - 1 (columns <= kTileColumns; the others zero).
    void unpack(const Product& p, int64_t n, int columns) {
        groups = p.K / 32;
        codes.resize(size_t(groups * 256 * kPrefillNT));
        s.assign(size_t(groups * kTileColumns), 0.0f);
        o = s;
        const uint8_t* rows[kTileColumns];  // taken once (Product::row tests for gathered rows)
        for (int c = 0; c < columns; ++c) rows[c] = p.row(n + c);
        for (int c = 0; c < columns; ++c) {
            const uint8_t* row = rows[c];
            for (int64_t g0 = 0; g0 < groups; g0 += 8) {
                const int span = int(std::min<int64_t>(8, groups - g0));
                Span<F> sp;
                sp.read_quantized(span_block<F>(row, g0), span);
                for (int j = 0; j < span; ++j) {
                    s[size_t((g0 + j) * kTileColumns + c)] = sp.s0[j];
                    o[size_t((g0 + j) * kTileColumns + c)] = sp.o0[j];
                }
            }
        }
        for (int nt = 0; nt < kPrefillNT; ++nt) {
            for (int64_t g = 0; g < groups; ++g) {
                __m256i v[8];
                FLEET_UNROLL
                for (int c = 0; c < 8; ++c) {
                    const int column = 8 * nt + c;
                    if (column >= columns) { v[c] = _mm256_setzero_si256(); continue; }
                    v[c] = F::codes(rows[column] + g * F::BYTES, 0);
                    if constexpr (kOffsetCodes<F>) v[c] = _mm256_xor_si256(v[c], mask8(0x80));
                }
                transpose8x8(v);
                FLEET_UNROLL
                for (int t = 0; t < 8; ++t)
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&codes[size_t(((g * 8 + t) * kPrefillNT + nt) * 32)]), v[t]);
            }
        }
    }
    TileView view() const { return TileView{groups, codes.data(), s.data(), o.data()}; }
};

template <class F, int MB>
static inline void tile_prefill(const Product& p, const TileView& t, int64_t n, int columns, int64_t m) {
    constexpr int NT = kPrefillNT, kZero = kZeroShift<F>;
    const QuantizedRows<MB> act(*p.a, m);
    const int8_t* const* q = act.q;
    const float *const *da = act.d, *const *ds0 = act.ds0, *const *ds1 = act.ds1;
    const int32_t* gsum[MB];
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i) gsum[i] = p.a->gsum_row(m + i);
    __m256 acc[2][MB][NT], corr[MB][NT];  // acc: each half's
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i)
        FLEET_UNROLL
        for (int c = 0; c < NT; ++c) {
            acc[0][i][c] = acc[1][i][c] = corr[i][c] = _mm256_setzero_ps();
        }
    for (int64_t g = 0; g < t.groups; ++g) {
        __m256i dot[2][MB][NT];  // each half's
        FLEET_UNROLL
        for (int h = 0; h < 2; ++h)
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) {
                const __m256i init = kZero < 0 ? _mm256_setzero_si256()
                                               : _mm256_set1_epi32(gsum[i][2 * g + h] * (1 << std::max(kZero, 0)));
                FLEET_UNROLL
                for (int c = 0; c < NT; ++c) dot[h][i][c] = init;
            }
        const uint8_t* codes = t.codes + g * 256 * NT;
#pragma GCC unroll 8
        for (int quad = 0; quad < 8; ++quad) {
            const int h = quad / 4;
            __m256i x[MB];
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) {
                int32_t four;
                __builtin_memcpy(&four, q[i] + g * 32 + 4 * quad, 4);
                x[i] = _mm256_set1_epi32(four);
            }
            FLEET_UNROLL
            for (int c = 0; c < NT; ++c) {
                const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (quad * NT + c) * 32));
                FLEET_UNROLL
                for (int i = 0; i < MB; ++i) dot[h][i][c] = FLEET_DPBUSD(dot[h][i][c], u, x[i]);
            }
        }
        FLEET_UNROLL
        for (int c = 0; c < NT; ++c) {
            const __m256 s = _mm256_loadu_ps(t.s + g * kTileColumns + 8 * c);
            const __m256 o = _mm256_loadu_ps(t.o + g * kTileColumns + 8 * c);
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) {
                const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(da[i][g]));
                acc[0][i][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[0][i][c]), sd, acc[0][i][c]);
                acc[1][i][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[1][i][c]), sd, acc[1][i][c]);
                if constexpr (F::OFFSET) {
                    corr[i][c] = _mm256_fmadd_ps(o, _mm256_set1_ps(ds0[i][g]), corr[i][c]);
                    corr[i][c] = _mm256_fmadd_ps(o, _mm256_set1_ps(ds1[i][g]), corr[i][c]);
                }
            }
        }
    }
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i)
        FLEET_UNROLL
        for (int c = 0; c < NT; ++c) {
            __m256 y = _mm256_add_ps(acc[0][i][c], acc[1][i][c]);
            if constexpr (F::OFFSET) y = _mm256_add_ps(y, corr[i][c]);
            store_columns(p, y, m + i, n + 8 * c, columns - 8 * c);
        }
}

template <class F>
static void rows_prefill(const Product& p, int64_t n0, int64_t n1) {
    thread_local UnpackedTile<F> buffer;
    sweep_tiles<kTileColumns, kPrefillMB>(p, n0, n1, &buffer, tile_prefill<F, kPrefillMB>, tile_prefill<F, 1>);
}

// Q4_K, Q5_K and Q6_K over many activation rows (kSuperHalves, driver.h): a tile of kTileColumns weight rows
// unpacked once as the 32-weight tiles are (each sub-block's codes transposed, an output column a lane), with each
// column's scales per half sub-block as int32 lanes. vpdpbusd sums c q into a lane per column, then:
//   Q4_K, Q5_K: for each chunk of a half (16 weights of Q4_K, 8 of Q5_K: their sum of c q fits 16 bits) one
//     vpdpwssd adds it times the column's scale to I_h; the minimums meet pairs of the activations' bsums the same
//     way (M_h).
//   Q6_K: a half's sum of c q (16 weights of 6 bits) does not fit 16 bits: it is multiplied by its scale in 32 bits
//     (vpmulld); the zero point's sum over g of scale_g bsum_g meets the bsums in pairs as the minimums do.
// The float operations are tile_super_halves', in its order: the same bits.
constexpr int kColumnsMB = 4;  // activation rows a pass (their float sums in memory: the integer sums take the registers)
// At and above this many activation rows: below, unpacking a tile (each column's scales reordered, the codes
// transposed) costs more than it saves, and the decode tiles run (Q5_K in cache, one core: 8 rows 2x,
// 16 rows 1.3x slower than them; 64 rows 1.15x, 256 rows 1.4-1.9x faster).
constexpr int kColumnsRows = 32;

struct ColumnsView {
    int64_t blocks;
    const uint8_t* codes;   // [blocks][8 sub-blocks][8 quads][kPrefillNT][8 columns][4 codes]
    const int32_t* scales;  // [blocks][16 halves g = 2 j + h][kTileColumns]: scale_g (int32)
    const int32_t* pairs;   // [blocks][2 h][4 pairs p][kTileColumns]: v_(4p + h) | v_(4p + 2 + h) << 16, v the
                            // minimums (Q4_K, Q5_K) or the scales (Q6_K: its zero point's)
    const float *d, *dmin;  // [blocks][kTileColumns]: d, and -dmin
};

// The int16 lane of F::super's scales (and minimums) that holds half g = 2 j + h's: lane h * 8 + j.
constexpr int super_lane(int g) { return (g % 2) * 8 + g / 2; }

template <class F>
struct UnpackedColumns {
    static_assert(kSuperHalves<F>, "Q4_K, Q5_K, Q6_K");
    int64_t blocks = 0;
    std::vector<uint8_t> codes;
    std::vector<int32_t> scales, pairs;
    std::vector<float> d, dmin;

    void unpack(const Product& p, int64_t n, int columns) {
        blocks = p.K / 256;
        codes.resize(size_t(blocks * 2048 * kPrefillNT));
        scales.assign(size_t(blocks * 16 * kTileColumns), 0);
        pairs.assign(size_t(blocks * 8 * kTileColumns), 0);
        d.assign(size_t(blocks * kTileColumns), 0.0f);
        dmin = d;
        const uint8_t* rows[kTileColumns];  // taken once (Product::row tests for gathered rows)
        for (int c = 0; c < columns; ++c) rows[c] = p.row(n + c);
        for (int64_t b = 0; b < blocks; ++b) {
            // each column's scales (and minimums) by the decode tile's unpacking (unpack.h F::super, super_lane),
            // then turned to the tile's [g][column] int32 rows
            alignas(32) int16_t sc[kTileColumns][16], mn[kTileColumns][16];
            for (int c = 0; c < columns; ++c) {
                SuperScales ss;
                F::super(rows[c] + b * F::BYTES, ss);
                _mm256_store_si256(reinterpret_cast<__m256i*>(sc[c]), ss.scales);
                _mm256_store_si256(reinterpret_cast<__m256i*>(mn[c]), ss.mins);
                d[size_t(b * kTileColumns + c)] = ss.d;
                dmin[size_t(b * kTileColumns + c)] = -ss.dmin;
            }
            const auto& v = F::OFFSET ? mn : sc;  // what meets the activations' sums in pairs
            for (int g = 0; g < 16; ++g) {
                int32_t* to = &scales[size_t((b * 16 + g) * kTileColumns)];
                for (int c = 0; c < columns; ++c) to[c] = sc[c][super_lane(g)];
            }
            for (int h = 0; h < 2; ++h)
                for (int pair = 0; pair < 4; ++pair) {
                    const int lo = super_lane(4 * pair + h), hi = super_lane(4 * pair + 2 + h);
                    int32_t* to = &pairs[size_t(((b * 2 + h) * 4 + pair) * kTileColumns)];
                    for (int c = 0; c < columns; ++c)
                        to[c] = int32_t(uint32_t(uint16_t(v[c][lo])) | uint32_t(uint16_t(v[c][hi])) << 16);
                }
        }
        for (int64_t b = 0; b < blocks; ++b)
            for (int j = 0; j < 8; ++j)
                for (int nt = 0; nt < kPrefillNT; ++nt) {
                    __m256i v[8];
                    FLEET_UNROLL
                    for (int c = 0; c < 8; ++c) {
                        const int column = 8 * nt + c;
                        v[c] = column < columns ? F::codes(rows[column] + b * F::BYTES, j)
                                                : _mm256_setzero_si256();
                    }
                    transpose8x8(v);
                    FLEET_UNROLL
                    for (int quad = 0; quad < 8; ++quad)
                        _mm256_storeu_si256(reinterpret_cast<__m256i*>(
                            &codes[size_t((((b * 8 + j) * 8 + quad) * kPrefillNT + nt) * 32)]), v[quad]);
                }
    }
    ColumnsView view() const { return ColumnsView{blocks, codes.data(), scales.data(), pairs.data(), d.data(), dmin.data()}; }
};

static inline __m256i broadcast32(const void* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// Sub-block j of block b: its two halves' integer sums added to sum[h] (Q4_K, Q5_K: 16-bit chunks times the scale
// by vpdpwssd; Q6_K: each half's 32-bit sum times its scale by vpmulld).
template <class F, int MB>
__attribute__((always_inline)) static inline void columns_sub_block(const ColumnsView& t, const int8_t* const* q, int64_t b, int j,
                                     __m256i (&sum)[2][MB][kPrefillNT]) {
    constexpr int NT = kPrefillNT;
    constexpr int kChunk = F::CODE_BITS == 5 ? 2 : 4;  // quads a partial sum holds (Q6_K: a half, in 32 bits)
    FLEET_UNROLL
    for (int h = 0; h < 2; ++h) {
        const __m256i* scale = reinterpret_cast<const __m256i*>(t.scales + ((b * 16 + 2 * j + h) * kTileColumns));
        FLEET_UNROLL
        for (int q0 = 4 * h; q0 < 4 * h + 4; q0 += kChunk) {
            __m256i part[MB][NT];
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i)
                FLEET_UNROLL
                for (int c = 0; c < NT; ++c) part[i][c] = _mm256_setzero_si256();
            FLEET_UNROLL
            for (int quad = q0; quad < q0 + kChunk; ++quad) {
                __m256i x[MB];
                FLEET_UNROLL
                for (int i = 0; i < MB; ++i) x[i] = broadcast32(q[i] + b * 256 + j * 32 + 4 * quad);
                FLEET_UNROLL
                for (int c = 0; c < NT; ++c) {
                    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                        t.codes + (((b * 8 + j) * 8 + quad) * NT + c) * 32));
                    FLEET_UNROLL
                    for (int i = 0; i < MB; ++i) part[i][c] = FLEET_DPBUSD(part[i][c], u, x[i]);
                }
            }
            FLEET_UNROLL
            for (int c = 0; c < NT; ++c) {
                const __m256i s = _mm256_loadu_si256(scale + c);
                FLEET_UNROLL
                for (int i = 0; i < MB; ++i) {
                    if constexpr (F::CODE_BITS <= 5)
                        sum[h][i][c] = FLEET_DPWSSD(sum[h][i][c], part[i][c], s);
                    else
                        sum[h][i][c] = _mm256_add_epi32(sum[h][i][c], _mm256_mullo_epi32(part[i][c], s));
                }
            }
        }
    }
}

template <class F, int MB>
static inline void tile_columns(const Product& p, const ColumnsView& t, int64_t n, int columns, int64_t m) {
    constexpr int NT = kPrefillNT;
    const SuperRows<MB> act(*p.a, m);
    const float* const* da = act.d;
    const int16_t* const* bsums = act.bsums;
    alignas(32) float acc[2][MB][NT][8];  // in memory, touched once a block: the integer sums take the registers
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i)
        FLEET_UNROLL
        for (int c = 0; c < NT; ++c) _mm256_store_ps(acc[0][i][c], _mm256_setzero_ps()), _mm256_store_ps(acc[1][i][c], _mm256_setzero_ps());
    for (int64_t b = 0; b < t.blocks; ++b) {
        __m256i sum[2][MB][NT];
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i)
            FLEET_UNROLL
            for (int c = 0; c < NT; ++c) sum[0][i][c] = sum[1][i][c] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) columns_sub_block<F, MB>(t, act.q, b, j, sum);
        FLEET_UNROLL
        for (int c = 0; c < NT; ++c) {
            const __m256 d = _mm256_loadu_ps(t.d + b * kTileColumns + 8 * c);
            const __m256 dmin = _mm256_loadu_ps(t.dmin + b * kTileColumns + 8 * c);
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) {
                const __m256 x = _mm256_set1_ps(da[i][b]);
                FLEET_UNROLL
                for (int h = 0; h < 2; ++h) {
                    __m256i psum = _mm256_setzero_si256();  // the minimums' M_h, or the zero point's sum
                    FLEET_UNROLL
                    for (int pair = 0; pair < 4; ++pair)
                        psum = FLEET_DPWSSD(psum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                      t.pairs + ((b * 2 + h) * 4 + pair) * kTileColumns + 8 * c)),
                                            broadcast32(bsums[i] + b * 16 + 8 * h + 2 * pair));
                    if constexpr (F::ZSHIFT >= 0) {
                        const __m256i is = _mm256_sub_epi32(sum[h][i][c], _mm256_slli_epi32(psum, F::ZSHIFT));
                        _mm256_store_ps(acc[h][i][c], _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, x),
                                                                      _mm256_load_ps(acc[h][i][c])));
                    } else {
                        const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h][i][c]), _mm256_mul_ps(d, x),
                                                         _mm256_load_ps(acc[h][i][c]));
                        _mm256_store_ps(acc[h][i][c], _mm256_fmadd_ps(_mm256_cvtepi32_ps(psum), _mm256_mul_ps(dmin, x), a));
                    }
                }
            }
        }
    }
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i)
        FLEET_UNROLL
        for (int c = 0; c < NT; ++c)
            store_columns(p, _mm256_add_ps(_mm256_load_ps(acc[0][i][c]), _mm256_load_ps(acc[1][i][c])), m + i, n + 8 * c,
                          columns - 8 * c);
}

#if FLEET_COLUMNS_512
#include "columns512.h"
#endif

template <class F>
static void rows_prefill_columns(const Product& p, int64_t n0, int64_t n1) {
    thread_local UnpackedColumns<F> buffer;
#if FLEET_COLUMNS_512
    sweep_tiles<kTileColumns, kColumns512MB>(p, n0, n1, &buffer, tile_columns512<F, kColumns512MB>,
                                             tile_columns512<F, 1>);
#else
    sweep_tiles<kTileColumns, kColumnsMB>(p, n0, n1, &buffer, tile_columns<F, kColumnsMB>, tile_columns<F, 1>);
#endif
}

// Activation rows a pass of the 256-weight tiles of 4 weight rows.
#if FLEET_VNNI
constexpr int kSuperMB = FLEET_WIDE_REGISTERS ? 4 : 2;  // 16 integer sums need 32 registers
#else
constexpr int kSuperMB = 2;
#endif
// The 256-weight types with unsigned codes over many activation rows: a tile of 4 weight rows is unpacked once
// (codes to bytes, each block's scales to registers), then every activation row meets it with the integer and
// float operations of tile_super, in the same order: bitwise the same results. Signed codes (IQ4_XS) keep
// tile_super: their sign is applied to each activation row's values (vpsignb), which nothing can hoist.
struct SuperTileView {  // by plain pointers (see TileView)
    int64_t blocks;
    const uint8_t* codes;
    const SuperScales* scales;
};

template <class F>
struct UnpackedSuperTile {
    static_assert(F::QK == 256 && !F::SIGNED, "see tile_super");
    int64_t blocks = 0;
    std::vector<uint8_t> codes;       // [4][blocks][256]
    std::vector<SuperScales> scales;  // [4][blocks]

    void unpack(const Product& p, int64_t n, int rows) {
        blocks = p.K / 256;
        codes.assign(size_t(4 * blocks * 256), 0);
        scales.assign(size_t(4 * blocks), SuperScales{_mm256_setzero_si256(), _mm256_setzero_si256(), 0.0f, 0.0f});
        for (int r = 0; r < rows; ++r) {
            const uint8_t* row = p.row(n + r);
            for (int64_t b = 0; b < blocks; ++b) {
                const size_t at = size_t(r * blocks + b);
                F::super(row + b * F::BYTES, scales[at]);
                for (int j = 0; j < 8; ++j)
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&codes[at * 256 + j * 32]), F::codes(row + b * F::BYTES, j));
            }
        }
    }
    SuperTileView view() const { return SuperTileView{blocks, codes.data(), scales.data()}; }
};

// Block b of an unpacked tile of 4 weight rows: each row's scales (sc) and its integer sums against MB activation
// rows (block_sums, as the decode tiles add them).
template <class F, int MB>
__attribute__((always_inline)) static inline void unpacked_block_sums(const SuperTileView& t, const int8_t* const* q,
                                                                      int64_t b, const SuperScales* (&sc)[4],
                                                                      __m256i (&isum)[4][MB]) {
    const uint8_t* codes[4];
    FLEET_UNROLL
    for (int r = 0; r < 4; ++r) { sc[r] = &t.scales[r * t.blocks + b]; codes[r] = &t.codes[size_t(r * t.blocks + b) * 256]; }
    block_sums<F, 4, MB>(q, b, [&](int r, int j) { return load32(codes[r] + j * 32); }, sc, isum);
}

template <class F, int MB>
static inline void tile_super_prefill(const Product& p, const SuperTileView& t, int64_t n, int rows, int64_t m) {
    constexpr int R = 4;
    const int64_t blocks = t.blocks;
    const SuperRows<MB> act(*p.a, m);
    const int8_t* const* q = act.q;
    const float* const* da = act.d;
    const int16_t* const* bsums = act.bsums;
    alignas(32) float acc[R][MB][8];  // in memory: the integer sums take the registers
    FLEET_UNROLL
    for (int r = 0; r < R; ++r)
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) _mm256_store_ps(acc[r][i], _mm256_setzero_ps());
    for (int64_t b = 0; b < blocks; ++b) {
        const SuperScales* sc[R];
        __m256i isum[R][MB];
        unpacked_block_sums<F, MB>(t, q, b, sc, isum);
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) {
            const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums[i] + b * 16));
            FLEET_UNROLL
            for (int r = 0; r < R; ++r)
                _mm256_store_ps(acc[r][i], block_end<F>(isum[r][i], *sc[r], bs, da[i][b], _mm256_load_ps(acc[r][i])));
        }
    }
    for (int r = 0; r < rows; ++r)
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) p.y[(m + i) * p.ldy + n + r] = hsum(_mm256_load_ps(acc[r][i]));
}

// The halves form's (kSuperHalves) 4-row tile over the same unpacked tile, with tile_super_halves' integer and
// float operations in its order: the same bits. Q6_K's from kPrefillRows to kColumnsRows activation rows: its codes
// (two loads and shifts a sub-block) pay for their unpacking there. Q4_K and Q5_K keep the decode tiles (this tile
// measured 1.2x faster than them at 8 rows in cache, but 0.8x and 0.95x from memory: kernel_ab.py, Llama-3.2-1B's
// gate, one core; the decode tiles prefetch, unpacking does not).
template <class F, int MB>
static inline void tile_super_halves_prefill(const Product& p, const SuperTileView& t, int64_t n, int rows, int64_t m) {
    constexpr int R = 4;
    const int64_t blocks = t.blocks;
    const SuperRows<MB> act(*p.a, m);
    __m256 acc[MB];
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const SuperScales* sc[R];
        __m256i isum[R][MB];
        unpacked_block_sums<F, MB>(t, act.q, b, sc, isum);
        halves_block_end<F, R, MB>(isum, sc, act, b, acc);
    }
    store_halves<MB>(p, acc, n, rows, m);
}

template <class F>
static void rows_prefill_super_halves(const Product& p, int64_t n0, int64_t n1) {
    thread_local UnpackedSuperTile<F> buffer;
    sweep_tiles<4, kSuperMB>(p, n0, n1, &buffer, tile_super_halves_prefill<F, kSuperMB>,
                             tile_super_halves_prefill<F, 1>);
}

template <class F>
static void rows_prefill_super(const Product& p, int64_t n0, int64_t n1) {
    thread_local UnpackedSuperTile<F> buffer;
    sweep_tiles<4, kSuperMB>(p, n0, n1, &buffer, tile_super_prefill<F, kSuperMB>, tile_super_prefill<F, 1>);
}
