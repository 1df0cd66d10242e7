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
        const uint8_t* row = p.w + n * p.row_bytes;
        for (int64_t m = 0; m < p.M; ++m) {
            const float* x = p.a->x_row(m);
            float acc = 0.0f;
            for (int64_t k = 0; k < p.K; ++k) acc = std::fma(float_weight(*p.fmt, row, k), x[k], acc);
            p.y[m * p.ldy + n] = acc;
        }
    }
}

// Integer weights, quantized activations: per half of 16, s d_x sum((c - z) q) + o d_x sum(q).
void quantized_rows(const Product& p, int64_t n0, int64_t n1) {
    const Format& f = *p.fmt;
    const int64_t blocks = p.K / f.block;
    const int subs = f.block / 32;
    std::vector<float> acc(size_t(p.M)), corr(size_t(p.M));
    SubBlock sb;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = p.w + n * p.row_bytes;
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
        const uint8_t* row = p.w + n * p.row_bytes;
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
    KernelTable t{"scalar", {}, {}};
    for (int id = 0; id < kNumTypeIds; ++id) {
        const Format* f = format_by_type(id);
        if (f == nullptr) continue;
        t.quantized[id] = f->is_float ? float_rows : quantized_rows;
        t.exact[id] = f->is_float ? float_rows : exact_rows;
    }
    return t;
}

}  // namespace

const KernelTable& scalar_kernels() {
    static const KernelTable table = make_table();
    return table;
}

}  // namespace fleet
