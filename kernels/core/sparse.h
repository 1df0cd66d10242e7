// The sparse FFN's kernels (fleet_gguf.GgufSparseFfn): the gate's activation and mask, and the axpy over the kept
// neurons' rows of a transposed down projection (down_t). The gate and up products are the ordinary ones
// (product.h); these are the two steps the dense FFN does not have.
//
// Every operation here is defined to the bit, the same in every instruction set (the scalar kernels in
// sparse_scalar.cpp are the oracle; the SIMD ones do the same float operations in the same order), and independent
// of the number of rows, the tiling and the thread split: a row's output is the same alone or in a batch.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "formats.h"

namespace fleet {

enum class GateActivation : int { Relu = 0, Silu = 1 };

// ---- fleet's SiLU, defined so that every instruction set computes the same bits (OpenVINO's Swish and libm's
// expf are not reproducible across builds and machines). e^x for x clamped to [kExpLo, kExpHi] (so 2^n stays a
// normal float): n = nearbyint(x log2 e), r = x - n ln2 in two fmas (Cody-Waite: ln 2 = kLn2Hi + kLn2Lo), e^r by
// its Taylor polynomial of degree 7 in Horner form (fmas; |r| <= 0.35: truncation below 6e-9 relative), times 2^n
// built in the exponent bits. Within 1 ulp of e^x on [-87, 88] (0.91 measured; kernels/tests/check_sparse.cpp
// bounds it at 2).
// silu(g) = g / (1 + exp(-g)); outside the clamp its error is below 1e-36 absolute (g > 87: g itself; g < -88: a
// tiny negative number instead of a smaller one). NaN stays NaN.
constexpr float kExpLo = -87.0f, kExpHi = 88.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;        // 9 significant bits: n kLn2Hi is exact for |n| <= 2^15
constexpr float kLn2Lo = -2.12194440e-4f;     // ln 2 - kLn2Hi
constexpr float kExpPoly[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

inline float fleet_exp(float x) {
    if (x != x) return x;  // NaN (the conversion of n to an integer below would be undefined)
    x = kExpLo > x ? kExpLo : x;  // written as the SIMD max/min compute them
    x = kExpHi < x ? kExpHi : x;
    const float n = std::nearbyint(x * kLog2e);
    float r = std::fma(n, -kLn2Hi, x);
    r = std::fma(n, -kLn2Lo, r);
    float p = kExpPoly[0];
    for (int i = 1; i < 8; ++i) p = std::fma(p, r, kExpPoly[i]);
    const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

inline float fleet_silu(float g) { return g / (1.0f + fleet_exp(-g)); }

// The gate's activation and mask over n values of one row, in place: g[i] becomes a(g[i]) (relu: g itself, which
// is a(g) wherever the mask keeps it; silu: fleet_silu) and keep[i] = 1 if |a(g[i])| > threshold, else 0 (relu:
// g > threshold; a NaN is never kept). threshold >= 0.
using ActivateKernel = void (*)(GateActivation act, float threshold, float* g, uint8_t* keep, int64_t n);

// y [M, D] f32 = H [M, F] x down_t [F, D] over the kept neurons only: down_t's row i (GGUF blocks along D) is neuron
// i's output column. For each row m and column j, from +0, in ascending order of the union U:
//   for each k with keep[m, k]:  t = h[m, k] * s   (s: the scale of the block of row U[k] holding column j;
//                                                   float types: t = h[m, k])
//                                y[m, j] = fma(t, c, y[m, j])   (c: the code minus the zero point as f32,
//                                                                Q4_0 c - 8, Q8_0 c; float types: the weight)
// A neuron not kept by row m adds nothing to row m. Tiles share the dequantized codes between rows and may keep
// partial sums in memory between chunks of neurons: every y[m, j] still sees this chain of operations exactly.
struct SparseAxpy {
    const Format* fmt = nullptr;       // down_t's type: one of is_axpy_type
    const uint8_t* w = nullptr;        // down_t's bytes, row i at w + i * row_bytes
    size_t row_bytes = 0;
    int64_t D = 0, M = 0;              // output columns, rows
    const int32_t* neurons = nullptr;  // U: the union of the rows' kept neurons, ascending
    int64_t count = 0;                 // |U|
    const float* h = nullptr;          // [M, count]: row m's a(g) u of neuron U[k] (read only where kept)
    const uint8_t* keep = nullptr;     // [M, count]: 1 where row m keeps U[k]; nullptr: every row keeps all of U
    float* y = nullptr;                // [M, ldy]
    int64_t ldy = 0;
};

// Columns [j0, j1) of every row (j0 and j1 multiples of the type's block, or j1 = D): threads take disjoint ranges.
using AxpyKernel = void (*)(const SparseAxpy& p, int64_t j0, int64_t j1);

// The down_t types the axpy runs: Q8_0 (the default the compiler writes), Q4_0, F16, BF16, F32.
inline bool is_axpy_type(BlockType t) {
    return t == BlockType::Q8_0 || t == BlockType::Q4_0 || t == BlockType::F16 || t == BlockType::BF16 ||
           t == BlockType::F32;
}
constexpr const char* kAxpyTypes = "Q8_0, Q4_0, F16, BF16, F32";

}  // namespace fleet
