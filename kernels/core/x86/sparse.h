// The sparse FFN's kernels of one x86 instruction set (core/sparse.h defines what they compute, to the bit):
// the gate's activation and mask, 8 values a register, and the axpy over down_t's kept rows as a tiled GEMM.
// Included by isa_*.cpp after driver.h, inside that set's namespace. Every float operation is the scalar
// oracle's (sparse_scalar.cpp), lane for lane and in its order, so the results are the same bits.

// ---- the gate's activation: fleet_exp and fleet_silu 8 lanes at a time (the same operations: sparse.h).
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(kExpLo), x);  // kExpLo > x ? kExpLo : x (a NaN x stays)
    x = _mm256_min_ps(_mm256_set1_ps(kExpHi), x);  // kExpHi < x ? kExpHi : x
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
    __m256 p = _mm256_set1_ps(kExpPoly[0]);
    FLEET_UNROLL
    for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline __m256 silu8(__m256 g) {
    const __m256 e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// 8 values of a row: the activation in place (silu), and the mask as 8 int32 lanes of -1 (kept) or 0.
static inline __m256i activate8(GateActivation act, __m256 threshold, float* g) {
    __m256 v = _mm256_loadu_ps(g);
    if (act == GateActivation::Relu) return _mm256_castps_si256(_mm256_cmp_ps(v, threshold, _CMP_GT_OQ));
    v = silu8(v);
    _mm256_storeu_ps(g, v);
    const __m256 magnitude = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    return _mm256_castps_si256(_mm256_cmp_ps(magnitude, threshold, _CMP_GT_OQ));  // a NaN is not kept
}

static void activate_simd(GateActivation act, float threshold, float* g, uint8_t* keep, int64_t n) {
    const __m256 t = _mm256_set1_ps(threshold);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {  // 4 registers of masks packed to 32 bytes of 0 or 1, in order
        __m256i k[4];
        FLEET_UNROLL
        for (int q = 0; q < 4; ++q) k[q] = activate8(act, t, g + i + 8 * q);
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(k[0], k[1]), _mm256_packs_epi32(k[2], k[3]));
        const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(keep + i), _mm256_and_si256(ordered, mask8(1)));
    }
    for (; i < n; ++i) {  // the scalar definitions: the same bits
        if (act == GateActivation::Relu) {
            keep[i] = g[i] > threshold;
        } else {
            g[i] = fleet_silu(g[i]);
            keep[i] = std::fabs(g[i]) > threshold;
        }
    }
}

// ---- down_t's types for the axpy, a block of 32 columns at a time: its 4 x 8 values of c (the code less the zero
// point, or the float weight) as f32, its scale s (integer types), its bytes (BYTES: a block's step in a row), and
// where a column's bytes lie in a row (the prefetch's span).
struct AxQ8_0 {
    static constexpr bool FLOAT = false;
    static constexpr int64_t BYTES = 34;
    static inline __m256 codes8(const uint8_t* blk, int q) {  // columns 8q .. 8q + 7 of the block
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * q))));
    }
    static inline float scale(const uint8_t* blk) { return f16(blk); }
    static inline int64_t first_byte(int64_t j) { return (j / 32) * 34; }
    static inline int64_t last_byte(int64_t j) { return (j / 32) * 34 + 2 + j % 32; }
};
struct AxQ4_0 {  // code j of a block: the low nibble of byte j (j < 16), the high nibble of byte j - 16
    static constexpr bool FLOAT = false;
    static constexpr int64_t BYTES = 18;
    static inline __m256 codes8(const uint8_t* blk, int q) {
        __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * (q % 2)));
        if (q >= 2) v = _mm_srli_epi16(v, 4);
        v = _mm_sub_epi8(_mm_and_si128(v, _mm_set1_epi8(15)), _mm_set1_epi8(8));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    }
    static inline float scale(const uint8_t* blk) { return f16(blk); }
    static inline int64_t first_byte(int64_t j) { return (j / 32) * 18; }
    static inline int64_t last_byte(int64_t j) { return (j / 32) * 18 + 2 + j % 16; }
};
template <BlockType T>
struct AxFloat {  // a "block": 32 consecutive weights
    static constexpr bool FLOAT = true;
    static constexpr int64_t W = T == BlockType::F32 ? 4 : 2;  // bytes a weight
    static constexpr int64_t BYTES = 32 * W;
    static inline __m256 codes8(const uint8_t* blk, int q) { return float8<T>(blk + 8 * q * W); }
    static inline float weight(const uint8_t* row, int64_t j) {
        static const Format* const f = format_by_type(int(T));
        return float_weight(*f, row, j);
    }
    static inline float scale(const uint8_t*) { return 1.0f; }
    static inline int64_t first_byte(int64_t j) { return j * W; }
    static inline int64_t last_byte(int64_t j) { return j * W + W - 1; }
};

#include "sparse_axpy.h"

static KernelTable with_sparse(KernelTable t) {
    t.activate = activate_simd;
    t.axpy[int(BlockType::Q8_0)] = axpy_rows<AxQ8_0>;
    t.axpy[int(BlockType::Q4_0)] = axpy_rows<AxQ4_0>;
    t.axpy[int(BlockType::F16)] = axpy_rows<AxFloat<BlockType::F16>>;
    t.axpy[int(BlockType::BF16)] = axpy_rows<AxFloat<BlockType::BF16>>;
    t.axpy[int(BlockType::F32)] = axpy_rows<AxFloat<BlockType::F32>>;
    return t;
}
