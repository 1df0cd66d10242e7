#include "sparse_ffn.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <openvino/core/parallel.hpp>
#include <vector>

#include "products.h"

namespace fleet {
namespace {

// up's kept rows are scattered: runs of kDirectRun or more consecutive neurons are multiplied where they lie; the
// others are copied kGatherRows at a time into a buffer (L1/L2) and multiplied there. Either way the same kernel
// computes each row, so the same bits (a product's rows do not depend on where its weights lie or how the rows are
// tiled). Copying, rather than calling the kernel on each short run, keeps the kernel's prefetch (the next rows of
// the matrix as stored: x86/driver.h) from reading the rows the mask dropped.
constexpr int64_t kDirectRun = 16;
constexpr int kGatherRows = 16;
constexpr int64_t kGatherAhead = 32;  // rows of up prefetched ahead of the copy

// Slack after the buffer's rows for the kernels' own prefetch past a tile's end (x86/driver.h: kPrefetchAhead and a
// tile of up to 4 rows), so that it touches the buffer rather than memory beyond.
size_t gather_slack(size_t row_bytes) { return 2048 + 4 * row_bytes; }

struct Workspace {
    Activations gate_a, up_a;
    std::vector<float> g;        // [M, F]: the gate, then a(g) where kept
    std::vector<uint8_t> keep;   // [M, F]
    std::vector<uint8_t> any;    // [F]: kept by some row (M > 1)
    std::vector<int32_t> U;      // the union of kept neurons, ascending
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

// A row of `bytes` copied 64 bytes at a time, each step prefetching (into L2) the same line of the row `ahead` (if
// any): measured here (1152-byte rows, half of them kept, from memory) 9.4 GB/s, against 6.6 with each row
// prefetched whole 8 rows ahead and 5.6 with no prefetch (the few line-fill buffers then stall the copy).
void copy_row(uint8_t* dst, const uint8_t* src, size_t bytes, const uint8_t* ahead) {
    size_t off = 0;
    for (; off + 64 <= bytes; off += 64) {
        if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T1);
        std::memcpy(dst + off, src + off, 64);
    }
    if (ahead != nullptr && off < bytes) _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T1);
    std::memcpy(dst + off, src + off, bytes - off);
}

// Rows [k0, k1) of the union of up (row U[k] of the matrix into column k of base.y), as described above.
void up_rows(const Product& base, RowsKernel kernel, const int32_t* U, int64_t k0, int64_t k1) {
    thread_local std::vector<uint8_t> buffer;
    const size_t rb = base.row_bytes;
    const size_t need = kGatherRows * rb + gather_slack(rb);
    if (buffer.size() < need) buffer.assign(need, 0);
    uint8_t* buf = buffer.data();
    Product p = base;
    int held = 0;
    int64_t first = k0;  // the union position of the buffer's first row
    const auto multiply = [&](const uint8_t* w, int64_t at, int64_t rows) {
        p.w = w;
        p.N = rows;
        p.y = base.y + at;
        kernel(p, 0, rows);
    };
    for (int64_t k = k0; k < k1;) {
        int64_t r = k + 1;
        while (r < k1 && U[r] == U[r - 1] + 1) ++r;
        if (r - k >= kDirectRun) {
            if (held) multiply(buf, first, held);
            held = 0;
            multiply(base.w + size_t(U[k]) * rb, k, r - k);
            k = r;
            continue;
        }
        for (; k < r; ++k) {
            if (held == 0) first = k;
            const uint8_t* ahead = k + kGatherAhead < k1 ? base.w + size_t(U[k + kGatherAhead]) * rb : nullptr;
            copy_row(buf + held * rb, base.w + size_t(U[k]) * rb, rb, ahead);
            if (++held == kGatherRows) {
                multiply(buf, first, held);
                held = 0;
            }
        }
    }
    if (held) multiply(buf, first, held);
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

// Step 3: u = x up^T on the union's rows only, then h = a(g) u where the row keeps the neuron, else 0.
void up_step(const SparseFfn& f, Workspace& ws, const float* x, int64_t M, int64_t count) {
    Product p = matrix_product(f, f.up, f.wu, f.up_bytes, M);
    p.y = sized(ws.h, size_t(M * std::max<int64_t>(count, 1)));
    p.ldy = count;
    const bool gate_exact = f.exact || f.gate->is_float;
    if (p.exact == gate_exact && (p.exact || (f.up->block == 256) == (f.gate->block == 256))) {
        p.a = &ws.gate_a;  // the same activations (quantized per the same group, or none)
    } else {
        prepare_activations(ws.up_a, x, M, f.d, *f.up, p.exact);
        p.a = &ws.up_a;
    }
    const RowsKernel kernel = select_kernel(p);
    const int32_t* U = ws.U.data();
    const float* a = ws.g.data();
    const uint8_t* keepU = M == 1 ? nullptr : ws.keepU.data();
    ov::parallel_nt_static(0, [&](const int ithr, const int nthr) {
        int64_t k0, k1;
        thread_rows(count, ithr, nthr, k0, k1);
        if (k0 >= k1) return;
        up_rows(p, kernel, U, k0, k1);
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
