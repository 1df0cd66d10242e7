// GGUF block formats read from their bytes: the scalar reference every SIMD path is tested against.
// Layouts from gguf-py's gguf/quants.py (dequantize_blocks of each type) and GGML_QUANT_SIZES.
#include "formats.h"

#include <cmath>
#include <cstring>

namespace fleet {

namespace {

const Format kFormats[] = {
    // type            name      block bytes float  signed per16 zero
    {BlockType::F32, "F32", 1, 4, true, false, false, 0},
    {BlockType::F16, "F16", 1, 2, true, false, false, 0},
    {BlockType::BF16, "BF16", 1, 2, true, false, false, 0},
    {BlockType::Q4_0, "Q4_0", 32, 18, false, false, false, 8},
    {BlockType::Q4_1, "Q4_1", 32, 20, false, false, false, 0},
    {BlockType::Q5_0, "Q5_0", 32, 22, false, false, false, 16},
    {BlockType::Q5_1, "Q5_1", 32, 24, false, false, false, 0},
    {BlockType::Q8_0, "Q8_0", 32, 34, false, true, false, 0},
    {BlockType::Q2_K, "Q2_K", 256, 84, false, false, true, 0},
    {BlockType::Q3_K, "Q3_K", 256, 110, false, false, true, 4},
    {BlockType::Q4_K, "Q4_K", 256, 144, false, false, false, 0},
    {BlockType::Q5_K, "Q5_K", 256, 176, false, false, false, 0},
    {BlockType::Q6_K, "Q6_K", 256, 210, false, false, true, 32},
    {BlockType::IQ4_NL, "IQ4_NL", 32, 18, false, true, false, 0},
    {BlockType::IQ4_XS, "IQ4_XS", 256, 136, false, true, false, 0},
    {BlockType::MXFP4, "MXFP4", 32, 17, false, true, false, 0},
};

uint16_t u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
uint32_t u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
float h(const uint8_t* p) { return f16_to_f32(u16(p)); }

// Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j packed in 12 bytes.
void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Codes j and j + 16 of a 32-weight block are the low and high nibbles of byte j.
int nibble(const uint8_t* qs, int j) { return j < 16 ? (qs[j] & 15) : (qs[j - 16] >> 4); }

// MXFP4's E8M0 exponent e as 2^(e - 128): the block's scale with E2M1's halving folded in
// (gguf-py MXFP4.e8m0_to_fp32_half). Exact in f32 (2^-128 and 2^-127 are subnormal).
float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? (0x00200000u << e) : (uint32_t(e - 1) << 23);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

}  // namespace

const int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const int8_t kE2m1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

float round_to_f16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint32_t sign = bits & 0x80000000u, mag = bits ^ sign;
    if (mag >= 0x7f800000u) return f;  // infinity, NaN
    if (mag >= 0x477ff000u) {          // 65520 and above: past the midpoint of 65504 and 2^16 (to even: infinity)
        bits = sign | 0x7f800000u;
    } else if (mag < 0x38800000u) {    // below 2^-14, f16's smallest normal: a multiple of 2^-24
        const float r = std::nearbyint(std::fabs(f) * 16777216.0f) * (1.0f / 16777216.0f);  // both exact scalings
        std::memcpy(&bits, &r, 4);
        bits |= sign;
    } else {                           // a normal f16: 10 of the 23 fraction bits kept, the rest rounded to even
        bits = sign | ((mag + 0xfffu + ((mag >> 13) & 1u)) & ~0x1fffu);
    }
    std::memcpy(&f, &bits, 4);
    return f;
}

float f16_to_f32(uint16_t v) {
    const uint32_t sign = uint32_t(v & 0x8000) << 16;
    const uint32_t exp = (v >> 10) & 31, mant = v & 1023;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: mant * 2^-24, exact in f32
            float f = std::ldexp(float(mant), -24);
            return sign ? -f : f;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

const Format* format_by_type(int type) {
    for (const Format& f : kFormats)
        if (int(f.type) == type) return &f;
    return nullptr;
}

const Format* format_by_name(const char* name) {
    for (const Format& f : kFormats)
        if (std::strcmp(f.name, name) == 0) return &f;
    return nullptr;
}

size_t row_bytes(const Format& f, int64_t cols) {
    if (cols <= 0 || cols % f.block) return 0;
    return size_t(cols / f.block) * size_t(f.bytes);
}

void block_scales(const Format& f, const uint8_t* b, float* s, float* o) {
    switch (f.type) {
    case BlockType::Q4_0: s[0] = s[1] = h(b); o[0] = o[1] = -8.0f * s[0]; break;
    case BlockType::Q5_0: s[0] = s[1] = h(b); o[0] = o[1] = -16.0f * s[0]; break;
    case BlockType::Q4_1:
    case BlockType::Q5_1: s[0] = s[1] = h(b); o[0] = o[1] = h(b + 2); break;
    case BlockType::Q8_0:
    case BlockType::IQ4_NL: s[0] = s[1] = h(b); o[0] = o[1] = 0.0f; break;
    case BlockType::MXFP4: s[0] = s[1] = e8m0_half(b[0]); o[0] = o[1] = 0.0f; break;
    case BlockType::Q2_K:
    case BlockType::Q3_K:
    case BlockType::Q4_K:
    case BlockType::Q5_K:
    case BlockType::Q6_K:
    case BlockType::IQ4_XS: {  // w = d scale (c - zero) - dmin min, per 16
        IntegerScales is;
        integer_scales(f, b, is);
        for (int g = 0; g < 16; ++g) {
            s[g] = is.d * float(is.scale[g]);
            o[g] = f.zero ? -float(f.zero) * s[g] : -(is.dmin * float(is.min[g]));
        }
        break;
    }
    default:
        for (int g = 0; g < 2 * (f.block / 32); ++g) s[g] = o[g] = 0.0f;
    }
}

bool integer_scales(const Format& f, const uint8_t* b, IntegerScales& out) {
    std::memset(out.min, 0, sizeof out.min);
    out.dmin = 0.0f;
    switch (f.type) {
    case BlockType::Q2_K:  // scales[16]: 4-bit scale | 4-bit min << 4, per 16 weights; d, dmin at 80
        out.d = h(b + 80);
        out.dmin = h(b + 82);
        for (int g = 0; g < 16; ++g) {
            out.scale[g] = int16_t(b[g] & 15);
            out.min[g] = int16_t(b[g] >> 4);
        }
        return true;
    case BlockType::Q3_K: {  // scales[12] at 96: 16 x 6 bits (low 4 in bytes 0-7, high 2 in bytes 8-11), less 32; d at 108
        const uint8_t* sc = b + 96;
        out.d = h(b + 108);
        for (int g = 0; g < 16; ++g) {
            const int lo = g < 8 ? (sc[g] & 15) : (sc[g - 8] >> 4);
            const int hi = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
            out.scale[g] = int16_t((lo | (hi << 4)) - 32);
        }
        return true;
    }
    case BlockType::Q4_K:
    case BlockType::Q5_K:  // d, dmin, scales[12]: 8 x (6-bit scale, 6-bit min), per 32
        out.d = h(b);
        out.dmin = h(b + 2);
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            scale_min_k4(b + 4, j, sc, m);
            out.scale[2 * j] = out.scale[2 * j + 1] = int16_t(sc);
            out.min[2 * j] = out.min[2 * j + 1] = int16_t(m);
        }
        return true;
    case BlockType::Q6_K:  // scales[16] int8 at 192, d at 208
        out.d = h(b + 208);
        for (int g = 0; g < 16; ++g) out.scale[g] = int8_t(b[192 + g]);
        return true;
    case BlockType::IQ4_XS:  // d, scales_h (u16: 2 bits a sub-block), scales_l[4] (4 bits a sub-block), less 32
        out.d = h(b);
        for (int j = 0; j < 8; ++j) {
            const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((u16(b + 2) >> (2 * j)) & 3) << 4);
            out.scale[2 * j] = out.scale[2 * j + 1] = int16_t(ls - 32);
        }
        return true;
    default:
        return false;
    }
}

void decode_sub(const Format& f, const uint8_t* b, int sub, SubBlock& out) {
    float s[16], o[16];
    block_scales(f, b, s, o);
    for (int k = 0; k < 2; ++k) {
        out.scale[k] = s[2 * sub + k];
        out.offset[k] = o[2 * sub + k];
    }
    int16_t* c = out.codes;
    switch (f.type) {
    case BlockType::Q4_0:
    case BlockType::Q4_1:
        for (int j = 0; j < 32; ++j) c[j] = int16_t(nibble(b + (f.type == BlockType::Q4_0 ? 2 : 4), j));
        break;
    case BlockType::Q5_0:
    case BlockType::Q5_1: {
        const int at = f.type == BlockType::Q5_0 ? 2 : 4;
        const uint32_t qh = u32(b + at);
        for (int j = 0; j < 32; ++j) c[j] = int16_t(nibble(b + at + 4, j) | (((qh >> j) & 1) << 4));
        break;
    }
    case BlockType::Q8_0:
        for (int j = 0; j < 32; ++j) c[j] = int8_t(b[2 + j]);
        break;
    case BlockType::IQ4_NL:
        for (int j = 0; j < 32; ++j) c[j] = kIq4Values[nibble(b + 2, j)];
        break;
    case BlockType::MXFP4:
        for (int j = 0; j < 32; ++j) c[j] = kE2m1Doubled[nibble(b + 1, j)];
        break;
    case BlockType::Q2_K:  // qs[64] at 16: weight e is 2 bits at shift 2 ((e % 128) / 32) of byte (e / 128) 32 + e % 32
        for (int j = 0; j < 32; ++j) {
            const int e = sub * 32 + j;
            c[j] = int16_t((b[16 + (e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3);
        }
        break;
    case BlockType::Q3_K:  // qs[64] at 32 as Q2_K's; hmask[32]: bit e / 32 of byte e % 32 (set: + 4)
        for (int j = 0; j < 32; ++j) {
            const int e = sub * 32 + j;
            const int low = (b[32 + (e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            c[j] = int16_t(low + 4 * ((b[e % 32] >> (e / 32)) & 1));  // q = low - 4 (1 - high), kept as q + 4
        }
        break;
    case BlockType::Q4_K:
    case BlockType::Q5_K: {  // qs[128]: sub-block j is nibble j % 2 of bytes (j / 2) 32 ..; Q5_K: bit j of qh[32]
        const bool five = f.type == BlockType::Q5_K;
        const uint8_t* qs = b + (five ? 48 : 16);
        for (int j = 0; j < 32; ++j) {
            int q = (qs[(sub / 2) * 32 + j] >> (4 * (sub % 2))) & 15;
            if (five) q |= ((b[16 + j] >> sub) & 1) << 4;
            c[j] = int16_t(q);
        }
        break;
    }
    case BlockType::Q6_K:  // ql[128]: 4 low bits; qh[64] at 128: 2 high bits
        for (int j = 0; j < 32; ++j) {
            const int e = sub * 32 + j, half = e / 128, r = e % 128;
            const int low = (b[half * 64 + r % 64] >> (4 * (r / 64))) & 15;
            const int high = (b[128 + half * 32 + r % 32] >> (2 * (r / 32))) & 3;
            c[j] = int16_t(low | (high << 4));
        }
        break;
    case BlockType::IQ4_XS:  // qs[128] at 8: 16 bytes a sub-block, nibbles as IQ4_NL's
        for (int j = 0; j < 32; ++j) c[j] = kIq4Values[nibble(b + 8 + sub * 16, j)];
        break;
    default:
        std::memset(c, 0, sizeof out.codes);
    }
}

}  // namespace fleet
