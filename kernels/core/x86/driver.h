// The row-tile kernels of one x86 instruction set, built from unpack.h. Included by isa_*.cpp with
// FLEET_DPBUSD(acc, u8, s8) defined (VNNI's vpdpbusd, or its exact AVX2 emulation) inside a namespace.
//
// A tile is R weight rows x MB activation rows. Every output sees the same float operations in the same order
// whatever R and MB are (tiles only share loads, and integer sums are exact in any order), so y[m, n] does not
// depend on the batch, the tiling or the thread split. The 32-weight types (tile_quantized) and the 256-weight
// ones (tile_super) say what each output computes.
// With a real vpdpbusd (VNNI) the decode tile saves an instruction a sub-block where it can, with the same
// integers and so the same results: signed codes enter as c + 128 (c xor 0x80, unsigned) with 128 x the lane
// sums subtracted in the dot's start, instead of |c| against q with c's sign; plain nibbles (Q4_0, Q4_1) enter
// in place, the high ones as 16 c (unpack.h nibble_halves), so the high lanes accumulate 16 x their products,
// exactly, and are divided by 16 (an exact shift) before the sub-block's total.

#include "quantize.h"

// Every loop over a tile's weight rows or activation rows is unrolled before GCC maps the tile's arrays to
// registers (scalar replacement): one such loop left with a variable index keeps all accumulators of the tile
// in memory, stored at every update (in-cache prefill at 256 rows then took 3-5% longer for Q4_0 and Q8_0 and
// 40% longer for Q4_1 here, one core).
#define FLEET_UNROLL _Pragma("GCC unroll 16")

// With a real vpdpbusd, signed codes enter as c + 128 (c xor 0x80, unsigned) and the zero point 128 = 2^7 is
// subtracted in the dot's start (AVX2's vpmaddubsw would saturate on them: it keeps |c| against q with c's sign).
template <class F>
constexpr bool kOffsetCodes = FLEET_VNNI && F::SIGNED;
template <class F>
constexpr int kZeroShift = kOffsetCodes<F> ? 7 : F::ZSHIFT;  // log2 of the integer zero point, -1: none

// Software prefetch in address order: while a tile's rows are read (interleaved, R streams), the bytes of the
// next tile and kPrefetchAhead beyond are requested front to back, at the pace the tile is consumed. The
// hardware prefetcher alone fed several interleaved streams at a fraction of one sequential read here.
// Into L2 (prefetcht1): measured faster than into L1 here (Q8_0 decode 1132 -> 853 us, Q4_K 826 -> 628 us),
// the demand loads then hit L2 while L1's few miss buffers stay free for them.
// 6 KiB ahead (before 1.5): on Zen 4 a 4-row Q4_K tile of K = 2048 takes ~180 ns, about one memory latency, so
// 1.5 KiB beyond the next tile came too late; from memory (16384 x 4096, one row, one core, kernel_ab.py) 6 KiB
// made Q4_K, Q4_0, Q6_K and Q8_0 1.06-1.13x faster on AVX-512 and 1.03-1.05x on AVX2, in-cache products level.
constexpr size_t kPrefetchAhead = 6144;

__attribute__((always_inline)) static inline void prefetch_next(const uint8_t* tile_end, size_t step, int64_t b) {
    const char* at = reinterpret_cast<const char*>(tile_end) + kPrefetchAhead + size_t(b) * step;
    for (size_t off = 0; off < step; off += 64) _mm_prefetch(at + off, _MM_HINT_T1);
}
constexpr int64_t kRowChunk = 64;    // activation rows per pass over a tile (keeps them in L2)

// What a tile of R weight rows from n prefetches at step b (of `step` bytes): contiguous rows (a matrix as stored)
// prefetch_next past the tile's end; gathered rows (Product::rows) each of the next tile's rows at step b's own
// bytes (step / R of each row), a tile ahead. Made once a tile, so that the loops test a register, not the
// Product (testing p.rows at each step made F16 at 64 rows 1.2-1.35x slower).
template <int R>
struct TilePrefetch {
    const uint8_t* end;           // contiguous: this tile's end; gathered: null (no flag of its own: a register less)
    const uint8_t* next[R] = {};  // gathered: the next tile's rows (null past the product's N)
    TilePrefetch(const Product& p, int64_t n, const uint8_t* tile_end) : end(p.rows == nullptr ? tile_end : nullptr) {
        if (p.rows != nullptr)
            for (int r = 0; r < R && n + R + r < p.N; ++r) next[r] = p.rows[n + R + r];
    }
    // Always inlined, as prefetch_next: GCC takes a function of prefetches alone for one without side effects and
    // drops the calls it does not inline (it did so to prefetch_next once called from here: decode 1.5-3x slower).
    __attribute__((always_inline)) inline void operator()(size_t step, int64_t b) const {
        if (end != nullptr) return prefetch_next(end, step, b);
        const size_t per_row = step / R, at = size_t(b) * per_row;
        FLEET_UNROLL
        for (int r = 0; r < R; ++r) {
            if (next[r] == nullptr) return;
            const char* row = reinterpret_cast<const char*>(next[r]) + at;
            for (size_t off = 0; off < per_row; off += 64) _mm_prefetch(row + off, _MM_HINT_T1);
            _mm_prefetch(row + per_row - 1, _MM_HINT_T1);
        }
    }
};

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// A tile's R weight rows: rows[r] is weight row n + r.
template <int R>
static inline void tile_rows(const Product& p, int64_t n, const uint8_t* (&rows)[R]) {
    FLEET_UNROLL
    for (int r = 0; r < R; ++r) rows[r] = p.row(n + r);
}

// A tile's R x MB float sums, at zero.
template <int R, int MB>
static inline void zero_sums(__m256 (&acc)[R][MB]) {
    FLEET_UNROLL
    for (int r = 0; r < R; ++r)
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();
}

// The scales of the 8 sub-blocks of 32 from group g0 of each row (a span), and the offsets where the type has
// any (ZSHIFT types: o = -z s, exact). `blk` is the span's first block in the row.
template <class F>
struct Span {
    alignas(32) float s0[8] = {}, s1[8] = {}, o0[8] = {}, o1[8] = {};
    // What the int8 path reads: s0 (and s1 of PER16 types), o0/o1 of OFFSET types (o1 = o0 unless PER16).
    inline void read_quantized(const uint8_t* blk, int span) { F::span(blk, span, s0, s1, o0, o1); }
    const float* offsets1() const { return F::PER16 ? o1 : o0; }  // the second halves' offsets
    // Every scale and offset of every half (the f32 path).
    inline void read(const uint8_t* blk, int span) {
        F::span(blk, span, s0, s1, o0, o1);
        if constexpr (!F::PER16) std::copy(s0, s0 + 8, s1);
        if constexpr (F::ZSHIFT >= 0)
            for (int j = 0; j < 8; ++j) { o0[j] = -float(1 << F::ZSHIFT) * s0[j]; o1[j] = -float(1 << F::ZSHIFT) * s1[j]; }
        else if constexpr (!F::OFFSET)
            for (int j = 0; j < 8; ++j) o0[j] = o1[j] = 0.0f;
        else if constexpr (!F::PER16)
            std::copy(o0, o0 + 8, o1);
    }
};

template <class F>
static inline const uint8_t* span_block(const uint8_t* row, int64_t g0) { return row + (g0 * 32 / F::QK) * F::BYTES; }
template <class F>
static inline const uint8_t* sub_block(const uint8_t* row, int64_t g0, int j, int& sub) {
    if constexpr (F::QK == 32) { sub = 0; return row + (g0 + j) * F::BYTES; }
    sub = j;
    return row + (g0 / 8) * F::BYTES;
}

static inline __m256 load8(const float* p, int span) {  // p[0..span), zeros after
    if (span == 8) return _mm256_loadu_ps(p);
    alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::copy(p, p + span, t);
    return _mm256_load_ps(t);
}

// Activation rows m .. m + MB - 1 of a product: their int8 values, scales, half sums and lane sums.
template <int MB>
struct QuantizedRows {
    const int8_t* q[MB];
    const float *d[MB], *ds0[MB], *ds1[MB];
    const int32_t* lanes[MB];
    QuantizedRows(const Activations& a, int64_t m) {
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) {
            q[i] = a.q_row(m + i); d[i] = a.d_row(m + i);
            ds0[i] = a.dsum_row(m + i, 0); ds1[i] = a.dsum_row(m + i, 1);
            lanes[i] = a.lanes_row(m + i);
        }
    }
};

// Activation row values of sub-block g (32 int8) and the dot's start: the lane sums times the weights' integer
// zero point (kHalves: nibble_halves' codes, whose high lanes' zero point is 16 times too), or 0 without one.
template <class F, bool kHalves>
static inline void group_activations(const int8_t* q, const int32_t* lanes, int64_t g, __m256i& qv, __m256i& init) {
    constexpr int kZero = kZeroShift<F>;
    qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * 32));
    if constexpr (kZero < 0) {
        init = _mm256_setzero_si256();
        return;
    }
    const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + g * 8));
    if constexpr (kHalves)
        init = _mm256_sllv_epi32(sums, _mm256_setr_epi32(kZero, kZero, kZero, kZero, kZero + 4, kZero + 4, kZero + 4,
                                                         kZero + 4));
    else
        init = _mm256_slli_epi32(sums, kZero);
}

// The integer sums over each half of 16 weights of R weight rows' dots against one activation row (8 lanes each):
// lane r holds row r's first half, lane 4 + r its second (R = 1: lanes 0 and 4). No shuffle crosses the two 128-bit
// lanes, so the second halves of nibble_halves' codes (16 x their sums) stay apart.
template <int R>
static inline __m256i half_sums(const __m256i* dot) {
    static_assert(R == 1 || R == 4, "tiles of 1 or 4 weight rows");
    if constexpr (R == 4)
        return _mm256_hadd_epi32(_mm256_hadd_epi32(dot[0], dot[1]), _mm256_hadd_epi32(dot[2], dot[3]));
    const __m256i h = _mm256_hadd_epi32(dot[0], dot[0]);
    return _mm256_hadd_epi32(h, h);
}

// A span's 8 per-group values of R rows (v[r] lane j: row r's value of group j) by group: out[j][r] (R = 1: out[j][0]).
template <int R>
__attribute__((always_inline)) static inline void by_group(const __m256* v, float (&out)[8][4]) {
    if constexpr (R == 4) {
        const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
        const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
        const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                             _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
        FLEET_UNROLL
        for (int j = 0; j < 4; ++j) {
            _mm_store_ps(out[j], _mm256_castps256_ps128(u[j]));
            _mm_store_ps(out[j + 4], _mm256_extractf128_ps(u[j], 1));
        }
    } else {
        static_assert(R == 1, "tiles of 1 or 4 weight rows");
        alignas(32) float row[8];
        _mm256_store_ps(row, v[0]);
        for (int j = 0; j < 8; ++j) _mm_store_ps(out[j], _mm_set_ss(row[j]));
    }
}

// The 32-weight types against quantized activations. Half h (16 weights) of sub-block g of weight row n against
// activation row m:
//   D = sum((c - z) q) over the half          an integer (exact in any order)
//   acc_h = fma(float(D), s d, acc_h)         one float multiply-add a half, in the order of g
//   corr = fma(o, dsum0, corr); corr = fma(o, dsum1, corr)   (types with a float offset o, per sub-block)
// and y = (acc_0 + acc_1) (+ corr). Each output is the same chains of float operations on the halves' integers
// however the integer work is laid out: here each row's 8-lane dot is summed to its halves (half_sums, 4 rows in
// one register); the prefill tiles (prefill.h) keep one output column a lane. Halves, measured here against one
// sum and quarters: one sum takes a third shuffle a sub-block (shuffles share one port), decode 15-40% slower from
// memory; quarters made prefill 1.3-1.5x slower than halves and decode no faster.
template <class F, int R, int MB>
static inline void tile_quantized(const Product& p, int64_t n, int64_t m) {
    static_assert(F::QK == 32 && !F::PER16, "the 32-weight types: one scale and offset per sub-block");
    constexpr bool kHalves = FLEET_VNNI && F::NIBBLES >= 0;  // nibbles in place, high lanes x16
    const int64_t groups = p.K / 32;
    const uint8_t* rows[R];
    tile_rows(p, n, rows);
    const QuantizedRows<MB> act(*p.a, m);
    const int8_t* const* q = act.q;
    const float *const *da = act.d, *const *ds0 = act.ds0, *const *ds1 = act.ds1;
    const int32_t* const* lanes = act.lanes;
    __m256 acc[MB];  // lane r: row r's first halves, lane 4 + r its second halves
    __m128 corr[MB];
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i) { acc[i] = _mm256_setzero_ps(); corr[i] = _mm_setzero_ps(); }
    const TilePrefetch<R> prefetch(p, n, rows[0] + R * p.row_bytes);
    constexpr size_t kSpanBytes = size_t(R) * (256 / F::QK) * F::BYTES;  // bytes of the tile in one span of 8 groups
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
        const int span = int(std::min<int64_t>(8, groups - g0));
        prefetch(kSpanBytes, g0 / 8);
        alignas(16) float s[8][4], o[8][4];  // by group: lane r row r's scale (offset)
        {
            __m256 sv[R], ov[R];
            FLEET_UNROLL
            for (int r = 0; r < R; ++r) {
                Span<F> sp;
                sp.read_quantized(span_block<F>(rows[r], g0), span);
                sv[r] = _mm256_load_ps(sp.s0);
                ov[r] = _mm256_load_ps(sp.o0);
            }
            by_group<R>(sv, s);
            if constexpr (F::OFFSET) by_group<R>(ov, o);
        }
        // one group of the span; a whole span (every span but a row's last) unrolled with no test between groups
        const auto group = [&](int j) __attribute__((always_inline)) {
            const int64_t g = g0 + j;
            __m256i qv[MB], init[MB];
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) group_activations<F, kHalves>(q[i], lanes[i], g, qv[i], init[i]);
            __m256i dot[MB][R];
            FLEET_UNROLL
            for (int r = 0; r < R; ++r) {
                const uint8_t* blk = rows[r] + g * F::BYTES;
                __m256i c, u;
                if constexpr (kHalves) {
                    u = c = nibble_halves(blk + F::NIBBLES);
                } else {
                    c = F::codes(blk, 0);
                    u = kOffsetCodes<F> ? _mm256_xor_si256(c, mask8(0x80)) : F::SIGNED ? _mm256_abs_epi8(c) : c;
                }
                FLEET_UNROLL
                for (int i = 0; i < MB; ++i) {
                    const __m256i v = F::SIGNED && !kOffsetCodes<F> ? _mm256_sign_epi8(qv[i], c) : qv[i];
                    dot[i][r] = FLEET_DPBUSD(init[i], u, v);
                }
            }
            const __m256 sj = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(s[j]));
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) {
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half_sums<R>(dot[i])), _mm256_mul_ps(sj, _mm256_set1_ps(da[i][g])), acc[i]);
                if constexpr (F::OFFSET) {
                    const __m128 oj = _mm_load_ps(o[j]);
                    corr[i] = _mm_fmadd_ps(oj, _mm_set1_ps(ds0[i][g]), corr[i]);
                    corr[i] = _mm_fmadd_ps(oj, _mm_set1_ps(ds1[i][g]), corr[i]);
                }
            }
        };
        if (span == 8) {
            FLEET_UNROLL
            for (int j = 0; j < 8; ++j) group(j);
        } else {
            for (int j = 0; j < span; ++j) group(j);
        }
    }
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i) {
        __m128 high = _mm256_extractf128_ps(acc[i], 1);
        if constexpr (kHalves) high = _mm_mul_ps(high, _mm_set1_ps(0.0625f));  // 16 x the halves' sums, exactly
        __m128 y = _mm_add_ps(_mm256_castps256_ps128(acc[i]), high);
        if constexpr (F::OFFSET) y = _mm_add_ps(y, corr[i]);
        alignas(16) float out[4];
        _mm_store_ps(out, y);
        FLEET_UNROLL
        for (int r = 0; r < R; ++r) p.y[(m + i) * p.ldy + n + r] = out[r];
    }
}

// ---- the 256-weight types: activations per 256 (activations.h), each block's sums kept in integers.
// Sub-block j of row n against activation row m: 16 int16 pair sums (vpmaddubsw: |c| <= 63 or the signed
// codes' magnitudes <= 127 against |q| <= 127, no pair saturates) times sub-block j's scales, accumulated in
// int32 over the block (vpdpwssd; at most 8 x 2 x 32258 x 128 < 2^31, exact). At the block's end, for 8 lanes:
//   isum -= z x (scales . bsums)   (an integer zero point, exact)
//   acc  += float(isum) x (d d_x)
//   acc  += float(mins . bsums) x (-dmin d_x)   (types with a minimum)
// and y = hsum(acc). The scalar reference sums the same integers (scalar.cpp superblock_rows).
static inline __m256i pick_scales(__m256i scales, int j) {  // sub-block j's: word j of each lane, everywhere
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16(short(((2 * j + 1) << 8) | (2 * j))));
}

// Activation rows m .. m + MB - 1 of a product for the 256-weight types: their int8 values, scales and bsums.
template <int MB>
struct SuperRows {
    const int8_t* q[MB];
    const float* d[MB];
    const int16_t* bsums[MB];
    SuperRows(const Activations& a, int64_t m) {
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) { q[i] = a.q_row(m + i); d[i] = a.d_row(m + i); bsums[i] = a.bsums_row(m + i); }
    }
};

// One block of 256 weights for R weight rows x MB activation rows, in integers: isum[r][i] = sum over sub-blocks j
// of its scales x the pair sums of codes(r, j) against row i's q. Shared by the decode tile (codes from the GGUF's
// blocks) and the prefill tile (codes unpacked), so that both add the same integers in the same order.
template <class F, int R, int MB, class Codes>
static inline void block_sums(const int8_t* const* q, int64_t b, Codes codes, const SuperScales* const* sc,
                              __m256i (&isum)[R][MB]) {
    FLEET_UNROLL
    for (int r = 0; r < R; ++r)
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) isum[r][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
        __m256i qv[MB];
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) qv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[i] + b * 256 + j * 32));
        FLEET_UNROLL
        for (int r = 0; r < R; ++r) {
            const __m256i c = codes(r, j);
            const __m256i u = F::SIGNED ? _mm256_abs_epi8(c) : c;
            const __m256i s = pick_scales(sc[r]->scales, j);
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) {
                const __m256i v = F::SIGNED ? _mm256_sign_epi8(qv[i], c) : qv[i];
                isum[r][i] = FLEET_DPWSSD(isum[r][i], _mm256_maddubs_epi16(u, v), s);
            }
        }
    }
}

// A block's end for one (weight row, activation row): the integer zero point, then the float multiply-adds.
template <class F>
static inline __m256 block_end(__m256i isum, const SuperScales& sc, __m256i bs, float da, __m256 acc) {
    if constexpr (F::ZSHIFT >= 0) isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(sc.scales, bs), F::ZSHIFT));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(sc.d * da), acc);
    if constexpr (F::OFFSET)
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sc.mins, bs)), _mm256_set1_ps(-sc.dmin * da), acc);
    return acc;
}

template <class F, int R, int MB>
static inline void tile_super(const Product& p, int64_t n, int64_t m) {
    const int64_t blocks = p.K / 256;
    const uint8_t* rows[R];
    tile_rows(p, n, rows);
    const SuperRows<MB> act(*p.a, m);
    const int8_t* const* q = act.q;
    const float* const* da = act.d;
    const int16_t* const* bsums = act.bsums;
    __m256 acc[R][MB];
    zero_sums(acc);
    const TilePrefetch<R> prefetch(p, n, rows[0] + R * p.row_bytes);
    for (int64_t b = 0; b < blocks; ++b) {
        prefetch(size_t(R) * F::BYTES, b);
        SuperScales sc[R];
        const SuperScales* scp[R];
        FLEET_UNROLL
        for (int r = 0; r < R; ++r) { F::super(rows[r] + b * F::BYTES, sc[r]); scp[r] = &sc[r]; }
        __m256i isum[R][MB];
        block_sums<F, R, MB>(q, b, [&](int r, int j) { return F::codes(rows[r] + b * F::BYTES, j); }, scp, isum);
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) {
            const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums[i] + b * 16));
            FLEET_UNROLL
            for (int r = 0; r < R; ++r) acc[r][i] = block_end<F>(isum[r][i], sc[r], bs, da[i][b], acc[r][i]);
        }
    }
    FLEET_UNROLL
    for (int r = 0; r < R; ++r)
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) p.y[(m + i) * p.ldy + n + r] = hsum(acc[r][i]);
}

// Q4_K, Q5_K (a scale and a minimum per sub-block of 32) and Q6_K (a scale per 16 weights, zero point 32) take the
// float operations of the 32-weight types, on each block's half sums: with I_h the block's integer sum over the
// first (h = 0) or second halves of its sub-blocks (sum over j of the half's scale x its sum((c - z) q)) and M_h the
// minimums' (sum over j of min_j x the half's sum(q)),
//   acc_h = fma(float(I_h), d d_x, acc_h); acc_h = fma(float(M_h), -dmin d_x, acc_h)     in the order of the blocks
// and y = acc_0 + acc_1, so that their prefill tile (prefill.h) can keep an output column a lane. At most
// 8 x 128 x 16 x 63 x 127 < 2^31 (Q6_K's I_h): exact in int32.
template <class F>
constexpr bool kSuperHalves = F::QK == 256 && F::HALVES;

// One block's end for R weight rows x MB activation rows in the halves form: the zero point or the minimums, then
// acc[i] (lane r: row r's first halves, lane 4 + r its second halves) gets the block's two float multiply-adds.
template <class F, int R, int MB>
__attribute__((always_inline)) static inline void halves_block_end(const __m256i (&isum)[R][MB],
                                                                   const SuperScales* const* sc, const SuperRows<MB>& act,
                                                                   int64_t b, __m256 (&acc)[MB]) {
    alignas(16) float dv[4] = {0, 0, 0, 0}, mv[4] = {0, 0, 0, 0};
    FLEET_UNROLL
    for (int r = 0; r < R; ++r) { dv[r] = sc[r]->d; mv[r] = -sc[r]->dmin; }
    const __m256 d8 = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(dv));
    const __m256 m8 = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(mv));
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i) {
        const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act.bsums[i] + b * 16));
        __m256i is[R], ms[R];
        FLEET_UNROLL
        for (int r = 0; r < R; ++r) {
            is[r] = isum[r][i];
            if constexpr (F::ZSHIFT >= 0)  // the zero point: z x sum over g of scale_g bsum_g, per half
                is[r] = _mm256_sub_epi32(is[r], _mm256_slli_epi32(_mm256_madd_epi16(sc[r]->scales, bs), F::ZSHIFT));
            if constexpr (F::OFFSET) ms[r] = _mm256_madd_epi16(sc[r]->mins, bs);
        }
        const __m256 x = _mm256_set1_ps(act.d[i][b]);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half_sums<R>(is)), _mm256_mul_ps(d8, x), acc[i]);
        if constexpr (F::OFFSET)
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half_sums<R>(ms)), _mm256_mul_ps(m8, x), acc[i]);
    }
}

// y of `rows` weight rows (<= R) from the halves' accumulators: acc_0 + acc_1.
template <int MB>
static inline void store_halves(const Product& p, const __m256 (&acc)[MB], int64_t n, int rows, int64_t m) {
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i) {
        alignas(16) float out[4];
        _mm_store_ps(out, _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1)));
        for (int r = 0; r < rows; ++r) p.y[(m + i) * p.ldy + n + r] = out[r];
    }
}

template <class F, int R, int MB>
static inline void tile_super_halves(const Product& p, int64_t n, int64_t m) {
    static_assert(kSuperHalves<F> && (R == 1 || R == 4), "Q4_K, Q5_K, Q6_K; tiles of 1 or 4 rows");
    const int64_t blocks = p.K / 256;
    const uint8_t* rows[R];
    tile_rows(p, n, rows);
    const SuperRows<MB> act(*p.a, m);
    __m256 acc[MB];  // lane r: row r's first halves, lane 4 + r its second halves
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
    const TilePrefetch<R> prefetch(p, n, rows[0] + R * p.row_bytes);
    for (int64_t b = 0; b < blocks; ++b) {
        prefetch(size_t(R) * F::BYTES, b);
        SuperScales sc[R];
        const SuperScales* scp[R];
        FLEET_UNROLL
        for (int r = 0; r < R; ++r) { F::super(rows[r] + b * F::BYTES, sc[r]); scp[r] = &sc[r]; }
        __m256i isum[R][MB];
        block_sums<F, R, MB>(act.q, b, [&](int r, int j) { return F::codes(rows[r] + b * F::BYTES, j); }, scp, isum);
        halves_block_end<F, R, MB>(isum, scp, act, b, acc);
    }
    store_halves<MB>(p, acc, n, R, m);
}

#include "float_tiles.h"  // f32 activations: the exact mode, and F16/BF16/F32 weights
#include "prefill.h"  // the tiles for many activation rows

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
    if constexpr (kSuperHalves<F>) {
        if (p.M >= kColumnsRows) return rows_prefill_columns<F>(p, n0, n1);
        if constexpr (F::PER16)  // Q6_K (see tile_super_halves_prefill)
            if (p.M >= kPrefillRows) return rows_prefill_super_halves<F>(p, n0, n1);
        sweep(p, n0, n1, tile_super_halves<F, 4, 2>, tile_super_halves<F, 4, 1>, tile_super_halves<F, 1, 2>,
              tile_super_halves<F, 1, 1>);
    } else if constexpr (F::QK == 256) {
        if constexpr (!F::SIGNED)
            if (p.M >= kPrefillRows) return rows_prefill_super<F>(p, n0, n1);
        sweep(p, n0, n1, tile_super<F, 4, 2>, tile_super<F, 4, 1>, tile_super<F, 1, 2>, tile_super<F, 1, 1>);
    } else {
        if constexpr (FLEET_VNNI || !F::SIGNED)
            if (p.M >= kPrefillRows) return rows_prefill<F>(p, n0, n1);
        sweep(p, n0, n1, tile_quantized<F, 4, 2>, tile_quantized<F, 4, 1>, tile_quantized<F, 1, 2>,
              tile_quantized<F, 1, 1>);
    }
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
    KernelTable t{isa, {}, {}, quantize_rows_simd};
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
