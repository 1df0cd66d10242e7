// GGUF block formats: sizes, and one block's 32-weight sub-blocks decoded from the bytes (scalar, from the
// format descriptions in gguf-py's gguf/quants.py and constants.py, GGML_QUANT_SIZES; the GGUF spec).
//
// Every integer type is read the same way: a sub-block of 32 weights is 32 codes c_j with, per half of 16,
// a scale s and an offset o such that w_j = s * c_j + o exactly (up to f32 rounding of s and o). Codes are
// unsigned (0..63) for the types with a zero point or a minimum, signed (-128..127) for the symmetric
// types (Q8_0, IQ4_NL, IQ4_XS, MXFP4), whose offset is 0.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fleet {

// GGML's type numbers (ggml.h enum ggml_type; gguf-py GGMLQuantizationType).
enum class BlockType : int {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
    Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30, MXFP4 = 39,
};
constexpr int kNumTypeIds = 40;

struct Format {
    BlockType type;
    const char* name;  // GGUF's name: "Q4_K"
    int block;          // weights per block (1 for the float types)
    int bytes;          // bytes per block
    bool is_float;      // F32/F16/BF16: no codes, f32 activations in every mode
    bool is_signed;     // codes are signed, offset 0 (the symmetric types)
    bool per16;         // scales per 16 weights (Q2_K, Q3_K, Q6_K): halves of a sub-block differ
    int zero;           // an integer zero point z of the codes (w = s (c - z), offset o = -z s), else 0
};

// The format of a GGUF type name or number; nullptr when fleet's kernels do not run it.
const Format* format_by_name(const char* name);
const Format* format_by_type(int type);

// Bytes of one row of `cols` weights; 0 when cols is not a whole number of blocks.
size_t row_bytes(const Format& f, int64_t cols);

// Sub-block `sub` (0 .. block/32 - 1) of the integer block at `blk`: codes[32] (unsigned 0..255 in the
// low byte, or signed), scale[2] and offset[2] (halves of 16 weights). Scalar reference of the format.
struct SubBlock {
    int16_t codes[32];
    float scale[2];
    float offset[2];
};
void decode_sub(const Format& f, const uint8_t* blk, int sub, SubBlock& out);

// Every scale and offset of the integer block at `blk`, per 16 weights: scale[block / 16], offset[block / 16].
void block_scales(const Format& f, const uint8_t* blk, float* scale, float* offset);

// The 256-weight types (K-quants, IQ4_XS) in integers: per 16 weights an integer scale and minimum, and the
// block's f32 d and dmin, such that w = d * scale[g] * (c - zero) - dmin * min[g] for the codes c of group g
// of 16 (zero: Format::zero; min all 0 for the types without one). |scale| <= 128, 0 <= min < 64.
struct IntegerScales {
    int16_t scale[16];
    int16_t min[16];
    float d, dmin;
};
// Fills `out` for the block at `blk` of a 256-weight type; false for any other type.
bool integer_scales(const Format& f, const uint8_t* blk, IntegerScales& out);

// f16 and bf16 bits to f32 (exact).
float f16_to_f32(uint16_t h);
// f rounded to the nearest f16 value (ties to even; beyond 65504 to infinity, as IEEE 754 conversion does), as
// an f32. NaN stays NaN.
float round_to_f16(float f);
inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

// The 16 non-linear values of IQ4_NL / IQ4_XS codes (gguf-py IQ4_NL.kvalues) and MXFP4's E2M1 values
// doubled (gguf-py MXFP4.kvalues; the halving is folded into the block's scale).
extern const int8_t kIq4Values[16];
extern const int8_t kE2m1Doubled[16];

}  // namespace fleet

namespace fleet {

// Weight k of a row of a float type (F32, F16, BF16) at `row`, as f32 (exact).
float float_weight(const Format& f, const uint8_t* row, int64_t k);

// One row of `cols` weights of type f at `row`, dequantized to f32: fma(s, c, o) per weight, the f32
// path's own values (float types converted exactly).
void dequantize_row(const Format& f, const uint8_t* row, int64_t cols, float* out);

}  // namespace fleet
