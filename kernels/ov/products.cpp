#include "products.h"

#include <openvino/core/parallel.hpp>

namespace fleet {

void prepare_activations(Activations& a, const float* x, int64_t rows, int64_t K, bool exact) {
    prepare(a, x, rows, K, !exact);
    if (exact) return;
    Activations* ap = &a;  // a thread_local of the caller must be reached through a pointer in the lambda
    if (rows >= 16)
        ov::parallel_for(size_t(rows), [ap](size_t m) { quantize_rows(*ap, int64_t(m), int64_t(m) + 1); });
    else
        quantize_rows(a, 0, rows);
}

void run_product(const Product& p) {
    const RowsKernel kernel = select_kernel(p);
    // Contiguous ranges of tiles of 4 rows per thread: each thread streams its own part of the blocks.
    ov::parallel_nt_static(0, [&](const int ithr, const int nthr) {
        const int64_t tiles = (p.N + 3) / 4;
        const int64_t t0 = tiles * ithr / nthr, t1 = tiles * (ithr + 1) / nthr;
        const int64_t n0 = std::min(p.N, t0 * 4), n1 = std::min(p.N, t1 * 4);
        if (n0 < n1) kernel(p, n0, n1);
    });
}

}  // namespace fleet
