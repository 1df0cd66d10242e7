// One matrix product y = x W^T over a GGUF tensor's blocks, and the kernel tables of the instruction sets.
#pragma once

#include <cstddef>
#include <cstdint>

#include "activations.h"
#include "formats.h"
#include "sparse.h"

namespace fleet {

// y [M, N] f32 = activations [M, K] x W^T, W [N, K] as GGUF blocks (row n at w + n * row_bytes).
// Kernels compute output columns [n0, n1) for every row m. Each y[m, n] is accumulated in one fixed order
// that depends on neither M, nor n0/n1, nor how rows are tiled: the same bits whatever the batch or the
// thread count (the invariance tests check it bitwise).
struct Product {
    const Format* fmt = nullptr;
    const uint8_t* w = nullptr;
    size_t row_bytes = 0;
    int64_t K = 0, N = 0, M = 0;
    const Activations* a = nullptr;
    float* y = nullptr;
    int64_t ldy = 0;  // y's row stride in floats (N for a plain product)
    bool exact = false;  // f32 activations (a->x) instead of the quantized ones
    // Gathered rows (the sparse FFN's kept rows of up): row n at rows[n] for n < N, instead of w + n * row_bytes.
    // The same kernels and bits; their prefetch then reads the next tile's own rows.
    const uint8_t* const* rows = nullptr;

    const uint8_t* row(int64_t n) const { return rows != nullptr ? rows[n] : w + n * row_bytes; }
};

using RowsKernel = void (*)(const Product& p, int64_t n0, int64_t n1);
// Quantizes rows [r0, r1) of prepared activations (activations.h): every instruction set gives the same bits.
using QuantizeRows = void (*)(Activations& a, int64_t r0, int64_t r1);

// An instruction set's kernels, indexed by GGML type number; a null entry falls back to the scalar one.
struct KernelTable {
    const char* isa;
    RowsKernel quantized[kNumTypeIds];
    RowsKernel exact[kNumTypeIds];
    QuantizeRows quantize;
    // The sparse FFN's (sparse.h): the axpy by down_t type (null: not a down_t type) and the gate's activation.
    AxpyKernel axpy[kNumTypeIds] = {};
    ActivateKernel activate = nullptr;
};

// The tables (dispatch.cpp picks one): scalar.cpp, isa_avx2.cpp, isa_avxvnni.cpp, isa_avx512vnni.cpp.
const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avxvnni_kernels();
const KernelTable& avx512vnni_kernels();

// The kernel that computes `p` on the chosen instruction set (or the scalar one where that set has none).
RowsKernel select_kernel(const Product& p);

// The sparse FFN's kernels on the chosen instruction set (the scalar ones where it has none); select_axpy: nullptr
// for a type that is not a down_t type (is_axpy_type).
AxpyKernel select_axpy(const Format& f);
ActivateKernel select_activate();

// The scalar table's sparse entries (sparse_scalar.cpp), which scalar.cpp's table takes.
void add_scalar_sparse(KernelTable& t);

// The instruction set in use: FLEET_KERNEL_ISA when set (scalar, avx2, avxvnni, avx512vnni; one this CPU
// lacks is an error), else the best this CPU has. Throws std::runtime_error naming the problem.
const KernelTable& active_kernels();

// Whether this CPU runs the named instruction set.
bool cpu_has(const char* isa);

}  // namespace fleet
