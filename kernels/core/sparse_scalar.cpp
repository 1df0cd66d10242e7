// The sparse FFN's portable kernels (sparse.h): the oracle of the SIMD ones, which must give the same bits, and the
// path of CPUs without AVX2. Written from the definitions in sparse.h, for clarity over speed.
#include <vector>

#include "product.h"

namespace fleet {
namespace {

void activate_scalar(GateActivation act, float threshold, float* g, uint8_t* keep, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        if (act == GateActivation::Relu) {
            keep[i] = g[i] > threshold;  // a(g) = g where kept; NaN is not kept
        } else {
            g[i] = fleet_silu(g[i]);
            keep[i] = std::fabs(g[i]) > threshold;
        }
    }
}

// One neuron's row of down_t over columns [j0, j1) into y: y[j] = fma(t, c_j, y[j]), t = h s per block (sparse.h).
void axpy_row(const Format& f, const uint8_t* row, float h, int64_t j0, int64_t j1, float* y) {
    if (f.is_float) {
        for (int64_t j = j0; j < j1; ++j) y[j] = std::fma(h, float_weight(f, row, j), y[j]);
        return;
    }
    SubBlock sb;  // the axpy's integer types have one scale a block of 32 and no float offset
    for (int64_t b = j0 / 32; b < j1 / 32; ++b) {
        decode_sub(f, row + b * f.bytes, 0, sb);
        const float t = h * sb.scale[0];
        for (int j = 0; j < 32; ++j) y[b * 32 + j] = std::fma(t, float(sb.codes[j] - f.zero), y[b * 32 + j]);
    }
}

// Row by row, neuron by neuron in ascending order: each y[m, j] gets its chain of fmas in order.
void axpy_scalar(const SparseAxpy& p, int64_t j0, int64_t j1) {
    for (int64_t m = 0; m < p.M; ++m) {
        float* y = p.y + m * p.ldy;
        for (int64_t j = j0; j < j1; ++j) y[j] = 0.0f;
        for (int64_t k = 0; k < p.count; ++k) {
            if (p.keep != nullptr && !p.keep[m * p.count + k]) continue;
            axpy_row(*p.fmt, p.w + size_t(p.neurons[k]) * p.row_bytes, p.h[m * p.count + k], j0, j1, y);
        }
    }
}

}  // namespace

void add_scalar_sparse(KernelTable& t) {
    t.activate = activate_scalar;
    for (int id = 0; id < kNumTypeIds; ++id) {
        const Format* f = format_by_type(id);
        if (f != nullptr && is_axpy_type(f->type)) t.axpy[id] = axpy_scalar;
    }
}

}  // namespace fleet
