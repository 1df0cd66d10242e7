// Rows dequantized to f32, for the embedding op (a token's row of the table) and the f32 path's reference.
#include <cmath>
#include <cstring>

#include "formats.h"

namespace fleet {

float float_weight(const Format& f, const uint8_t* row, int64_t k) {
    if (f.type == BlockType::F32) {
        float v;
        std::memcpy(&v, row + 4 * k, 4);
        return v;
    }
    const uint16_t bits = uint16_t(row[2 * k] | (row[2 * k + 1] << 8));
    return f.type == BlockType::F16 ? f16_to_f32(bits) : bf16_to_f32(bits);
}

void dequantize_row(const Format& f, const uint8_t* row, int64_t cols, float* out) {
    if (f.is_float) {
        for (int64_t k = 0; k < cols; ++k) out[k] = float_weight(f, row, k);
        return;
    }
    SubBlock sb;
    const int subs = f.block / 32;
    for (int64_t b = 0; b < cols / f.block; ++b)
        for (int sub = 0; sub < subs; ++sub) {
            decode_sub(f, row + b * f.bytes, sub, sb);
            float* o = out + (b * subs + sub) * 32;
            for (int j = 0; j < 32; ++j) o[j] = std::fma(sb.scale[j / 16], float(sb.codes[j]), sb.offset[j / 16]);
        }
}

}  // namespace fleet
