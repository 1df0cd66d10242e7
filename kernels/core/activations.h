// Activations quantized as fleet's integer kernels take them: int8 per group of 32 (or of 256, for the
// 256-weight types) with a scale d (f16 for groups of 32, f32 for 256).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "formats.h"

namespace fleet {

// One product's activations, rows x cols, in the two forms the kernels read. For each group g of 32 values of a
// row: d = max|x| / 127 rounded to the nearest f16 (llama.cpp keeps its block_q8_0's d in f16, so the products
// equal its), q = rint(x * (127 / max|x|)) clamped to [-127, 127] (all zero when max|x| is 0), and per half h of 16
// values dsum = d * sum(q over the half). The float64 references in the tests quantize the same way
// (tests/unit/test_kernels.py). The SIMD kernels also read, per group, the sums of q over each 4 consecutive values
// negated (the int32 lanes of vpdpbusd) and their totals per half: an integer zero point z of the weights' codes is then subtracted
// exactly, sum((c - z) q) = dpbusd(z x lanes, c, q), or z x gsum plus the dots where a lane is an output column.
//
// For the 256-weight types the group is 256 (one d per block of the weights, in f32 as llama.cpp's block_q8_K keeps
// it) and the kernels read, per block, the sums of q over each 16 values (int16) in the order b0, b2, ..., b14, b1,
// b3, ..., b15: the order of the weights' integer scales in a register (x86/unpack.h), so that one vpmaddwd gives
// sum over g of scale[g] x b[g].
struct Activations {
    int64_t rows = 0, cols = 0;
    int group = 32;             // values per scale d: 32 or 256
    const float* x = nullptr;  // f32 [rows, cols]: the exact mode and the float weight types read these
    std::vector<int8_t> q;      // [rows, cols]
    std::vector<float> d;       // [rows, cols / group]
    std::vector<float> dsum;    // [rows, 2, cols / 32]: d * sum(q) over the first, then the second half of each group
    std::vector<int32_t> lanes; // [rows, cols / 32, 8]: -(q[4l] + q[4l+1] + q[4l+2] + q[4l+3]) per group
    std::vector<int32_t> gsum;  // [rows, cols / 32, 2]: -sum(q) over each half of 16 of a group
    std::vector<int16_t> bsums; // [rows, cols / 256, 16] (group 256): sums of q per 16, in the order above

    const int8_t* q_row(int64_t m) const { return q.data() + m * cols; }
    const float* d_row(int64_t m) const { return d.data() + m * (cols / group); }
    const int16_t* bsums_row(int64_t m) const { return bsums.data() + m * (cols / 16); }
    const float* dsum_row(int64_t m, int half) const { return dsum.data() + (2 * m + half) * (cols / 32); }
    const int32_t* lanes_row(int64_t m) const { return lanes.data() + m * (cols / 32) * 8; }
    const int32_t* gsum_row(int64_t m) const { return gsum.data() + m * (cols / 32) * 2; }
    const float* x_row(int64_t m) const { return x + m * cols; }
};

// Sizes the buffers of `a` for rows x cols (cols a multiple of `group`, 32 or 256) and points it at x.
void prepare(Activations& a, const float* x, int64_t rows, int64_t cols, bool quantized, int group);

// Where sum b[g] (g = 0..15, the sums of q per 16 of a block of 256) is kept in the block's bsums.
inline int bsum_slot(int g) { return g % 2 ? 8 + g / 2 : g / 2; }

// A group of 32's scale d as kept: rounded to f16 as llama.cpp's block_q8_0 keeps it, except where f16 cannot hold it
// (max|x| > 8.3e6, where llama.cpp's d becomes infinity): there d stays f32.
inline float group32_scale(float d) {
    const float h = round_to_f16(d);
    return std::isinf(h) ? d : h;
}

// Quantizes rows [r0, r1) of a prepared `a` (rows are independent: callers split them over threads).
void quantize_rows(Activations& a, int64_t r0, int64_t r1);

}  // namespace fleet
