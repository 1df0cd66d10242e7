#include "sparse_ffn.h"

#include <algorithm>
#include <cstring>
#include <openvino/core/parallel.hpp>
#include <vector>

#include "products.h"

namespace fleet {
namespace {

struct Workspace {
    Activations gate_a, up_a;
    std::vector<float> g;        // [M, F]: the gate, then a(g) where kept
    std::vector<uint8_t> keep;   // [M, F]
    std::vector<uint8_t> any;    // [F]: kept by some row (M > 1)
    std::vector<int32_t> U;      // the union of kept neurons, ascending
    std::vector<const uint8_t*> up_rows;  // [|U|]: row U[k] of up
    std::vector<float> h;        // [M, |U|]: u, then h = a(g) u (0 where the row drops the neuron)
    std::vector<uint8_t> keepU;  // [M, |U|] (M > 1)
};

template <class T>
T* sized(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

// The positions i of the nonzero flags[0..n) into out, ascending (branch-free); returns their number.
int64_t compact(const uint8_t* flags, int64_t n, int32_t* out) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
        out[count] = int32_t(i);
        count += flags[i] != 0;
    }
    return count;
}

// A product of M rows of x with one of the FFN's matrices (gate or up: its type, blocks and row bytes), in the
// op's precision (float weights always exact); the caller sets N, y and the activations.
Product matrix_product(const SparseFfn& f, const Format* fmt, const uint8_t* w, size_t row_bytes, int64_t M) {
    Product p;
    p.fmt = fmt;
    p.w = w;
    p.row_bytes = row_bytes;
    p.K = f.d;
    p.M = M;
    p.exact = f.exact || fmt->is_float;
    return p;
}

// Step 1: g = x gate^T, every row of gate, then a(g) and the mask, each thread on its own rows.
void gate_step(const SparseFfn& f, Workspace& ws, const float* x, int64_t M) {
    Product p = matrix_product(f, f.gate, f.wg, f.gate_bytes, M);
    p.N = f.F;
    p.y = sized(ws.g, size_t(M * f.F));
    p.ldy = f.F;
    prepare_activations(ws.gate_a, x, M, f.d, *f.gate, p.exact);
    p.a = &ws.gate_a;
    uint8_t* keep = sized(ws.keep, size_t(M * f.F));
    const RowsKernel kernel = select_kernel(p);
    const ActivateKernel activate = select_activate();
    ov::parallel_nt_static(0, [&](const int ithr, const int nthr) {
        int64_t n0, n1;
        thread_rows(f.F, ithr, nthr, n0, n1);
        if (n0 >= n1) return;
        kernel(p, n0, n1);
        for (int64_t m = 0; m < M; ++m) activate(f.act, f.threshold, p.y + m * f.F + n0, keep + m * f.F + n0, n1 - n0);
    });
}

// Step 2: the union U of the rows' kept neurons, and (M > 1) which row keeps which of U. Returns |U|.
int64_t union_step(const SparseFfn& f, Workspace& ws, int64_t M) {
    int32_t* U = sized(ws.U, size_t(f.F));
    if (M == 1) return compact(ws.keep.data(), f.F, U);
    uint8_t* any = sized(ws.any, size_t(f.F));
    std::memcpy(any, ws.keep.data(), size_t(f.F));
    for (int64_t m = 1; m < M; ++m) {
        const uint8_t* row = ws.keep.data() + m * f.F;
        for (int64_t i = 0; i < f.F; ++i) any[i] |= row[i];
    }
    const int64_t count = compact(any, f.F, U);
    uint8_t* keepU = sized(ws.keepU, size_t(M * count));
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < count; ++k) keepU[m * count + k] = ws.keep[size_t(m * f.F + U[k])];
    return count;
}

// Step 3: u = x up^T on the union's rows only (gathered rows of the same kernels: Product::rows; all of up as stored
// when nothing is dropped), then h = a(g) u where the row keeps the neuron, else 0.
void up_step(const SparseFfn& f, Workspace& ws, const float* x, int64_t M, int64_t count) {
    Product p = matrix_product(f, f.up, f.wu, f.up_bytes, M);
    p.N = count;
    p.y = sized(ws.h, size_t(M * std::max<int64_t>(count, 1)));
    p.ldy = count;
    const int32_t* U = ws.U.data();
    if (count < f.F) {
        const uint8_t** rows = sized(ws.up_rows, size_t(count));
        for (int64_t k = 0; k < count; ++k) rows[k] = f.wu + size_t(U[k]) * f.up_bytes;
        p.rows = rows;
    }
    const bool gate_exact = f.exact || f.gate->is_float;
    if (p.exact == gate_exact && (p.exact || (f.up->block == 256) == (f.gate->block == 256))) {
        p.a = &ws.gate_a;  // the same activations (quantized per the same group, or none)
    } else {
        prepare_activations(ws.up_a, x, M, f.d, *f.up, p.exact);
        p.a = &ws.up_a;
    }
    const RowsKernel kernel = select_kernel(p);
    const float* a = ws.g.data();
    const uint8_t* keepU = M == 1 ? nullptr : ws.keepU.data();
    ov::parallel_nt_static(0, [&](const int ithr, const int nthr) {
        int64_t k0, k1;
        thread_rows(count, ithr, nthr, k0, k1);
        if (k0 >= k1) return;
        kernel(p, k0, k1);
        for (int64_t m = 0; m < M; ++m)
            for (int64_t k = k0; k < k1; ++k) {
                float& h = p.y[m * count + k];
                h = keepU == nullptr || keepU[m * count + k] ? a[m * f.F + U[k]] * h : 0.0f;
            }
    });
}

// Step 4: y = h down_t over the union, the columns split between the threads in whole blocks.
void axpy_step(const SparseFfn& f, Workspace& ws, int64_t M, int64_t count, float* y) {
    SparseAxpy p;
    p.fmt = f.down_t;
    p.w = f.wd;
    p.row_bytes = f.down_bytes;
    p.D = f.d;
    p.M = M;
    p.neurons = ws.U.data();
    p.count = count;
    p.h = ws.h.data();
    p.keep = M == 1 ? nullptr : ws.keepU.data();
    p.y = y;
    p.ldy = f.d;
    const AxpyKernel axpy = select_axpy(*f.down_t);
    const int64_t unit = f.down_t->is_float ? 8 : f.down_t->block, units = (f.d + unit - 1) / unit;
    ov::parallel_nt_static(0, [&](const int ithr, const int nthr) {
        const int64_t j0 = std::min(f.d, units * ithr / nthr * unit), j1 = std::min(f.d, units * (ithr + 1) / nthr * unit);
        if (j0 < j1) axpy(p, j0, j1);
    });
}

}  // namespace

void run_sparse_ffn(const SparseFfn& f, const float* x, int64_t M, float* y) {
    thread_local Workspace ws;  // reused across calls: no allocation per decode step
    gate_step(f, ws, x, M);
    const int64_t count = union_step(f, ws, M);
    up_step(f, ws, x, M, count);
    axpy_step(f, ws, M, count, y);
}

}  // namespace fleet
