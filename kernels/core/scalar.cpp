// The portable scalar kernels: every type, both modes. They are the SIMD kernels' oracle in the tests and
// the path of CPUs without AVX2. Written from the formats (formats.cpp), for clarity over speed.
#include <cmath>
#include <vector>

#include "product.h"

namespace fleet {
namespace {

// Float weights: y = sum over k of w x in order (both modes).
void float_rows(const Product& p, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = p.row(n);
        for (int64_t m = 0; m < p.M; ++m) {
            const float* x = p.a->x_row(m);
            float acc = 0.0f;
            for (int64_t k = 0; k < p.K; ++k) acc = std::fma(float_weight(*p.fmt, row, k), x[k], acc);
            p.y[m * p.ldy + n] = acc;
        }
    }
}

// The 256-weight types, activations quantized per 256: each block's sums are integers, exact,
//   isum = sum over g of scale[g] sum((c - z) q) (16 values a group), msum = sum over g of min[g] b[g],
// then y += float(isum) (d d_x) + float(msum) (-dmin d_x).
void superblock_rows(const Product& p, int64_t n0, int64_t n1) {
    const Format& f = *p.fmt;
    const int64_t blocks = p.K / 256;
    IntegerScales is;
    SubBlock sb;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = p.row(n);
        for (int64_t m = 0; m < p.M; ++m) {
            const int8_t* q = p.a->q_row(m);
            const int16_t* bsums = p.a->bsums_row(m);
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t* blk = row + b * f.bytes;
                integer_scales(f, blk, is);
                int32_t isum = 0, msum = 0;
                for (int sub = 0; sub < 8; ++sub) {
                    decode_sub(f, blk, sub, sb);
                    for (int half = 0; half < 2; ++half) {
                        const int g = 2 * sub + half;
                        int32_t dot = 0;
                        for (int j = 16 * half; j < 16 * half + 16; ++j)
                            dot += (int32_t(sb.codes[j]) - f.zero) * q[b * 256 + sub * 32 + j];
                        isum += int32_t(is.scale[g]) * dot;
                        msum += int32_t(is.min[g]) * bsums[b * 16 + bsum_slot(g)];
                    }
                }
                const float d = p.a->d_row(m)[b];
                acc += float(isum) * (is.d * d);
                acc += float(msum) * (-is.dmin * d);
            }
            p.y[m * p.ldy + n] = acc;
        }
    }
}

// Integer weights, quantized activations: per half of 16, s d_x sum((c - z) q) + o d_x sum(q).
void quantized_rows(const Product& p, int64_t n0, int64_t n1) {
    const Format& f = *p.fmt;
    if (f.block == 256) return superblock_rows(p, n0, n1);
    const int64_t blocks = p.K / f.block;
    const int subs = f.block / 32;
    std::vector<float> acc(size_t(p.M)), corr(size_t(p.M));
    SubBlock sb;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = p.row(n);
        std::fill(acc.begin(), acc.end(), 0.0f);
        std::fill(corr.begin(), corr.end(), 0.0f);
        for (int64_t b = 0; b < blocks; ++b) {
            for (int sub = 0; sub < subs; ++sub) {
                decode_sub(f, row + b * f.bytes, sub, sb);
                const int64_t g = b * subs + sub;  // the activations' group of 32
                for (int64_t m = 0; m < p.M; ++m) {
                    const int8_t* q = p.a->q_row(m) + g * 32;
                    const float d = p.a->d_row(m)[g];
                    for (int half = 0; half < 2; ++half) {
                        int dot = 0;  // an integer zero point is subtracted exactly, other offsets as o d sum(q)
                        for (int j = half * 16; j < half * 16 + 16; ++j) dot += (int(sb.codes[j]) - f.zero) * int(q[j]);
                        acc[m] += float(dot) * (sb.scale[half] * d);
                        if (f.zero == 0) corr[m] += sb.offset[half] * p.a->dsum_row(m, half)[g];
                    }
                }
            }
        }
        for (int64_t m = 0; m < p.M; ++m) p.y[m * p.ldy + n] = acc[m] + corr[m];
    }
}

// Integer weights, f32 activations: w = fma(s, c, o) exactly as dequantized, then sum of w x in order.
void exact_rows(const Product& p, int64_t n0, int64_t n1) {
    const Format& f = *p.fmt;
    const int64_t blocks = p.K / f.block;
    const int subs = f.block / 32;
    std::vector<float> acc(size_t(p.M));
    SubBlock sb;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = p.row(n);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t b = 0; b < blocks; ++b) {
            for (int sub = 0; sub < subs; ++sub) {
                decode_sub(f, row + b * f.bytes, sub, sb);
                float w[32];
                for (int j = 0; j < 32; ++j) w[j] = std::fma(sb.scale[j / 16], float(sb.codes[j]), sb.offset[j / 16]);
                const int64_t k0 = (b * subs + sub) * 32;
                for (int64_t m = 0; m < p.M; ++m) {
                    const float* x = p.a->x_row(m) + k0;
                    for (int j = 0; j < 32; ++j) acc[m] = std::fma(w[j], x[j], acc[m]);
                }
            }
        }
        for (int64_t m = 0; m < p.M; ++m) p.y[m * p.ldy + n] = acc[m];
    }
}

KernelTable make_table() {
    KernelTable t{"scalar", {}, {}, quantize_rows};
    for (int id = 0; id < kNumTypeIds; ++id) {
        const Format* f = format_by_type(id);
        if (f == nullptr) continue;
        t.quantized[id] = f->is_float ? float_rows : quantized_rows;
        t.exact[id] = f->is_float ? float_rows : exact_rows;
    }
    add_scalar_sparse(t);
    return t;
}

}  // namespace

const KernelTable& scalar_kernels() {
    static const KernelTable table = make_table();
    return table;
}

}  // namespace fleet
