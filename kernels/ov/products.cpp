#include "products.h"

#include <openvino/core/parallel.hpp>
#include <vector>

namespace fleet {

void prepare_activations(Activations& a, const float* x, int64_t rows, int64_t K, const Format& f, bool exact) {
    prepare(a, x, rows, K, !exact, f.block == 256 ? 256 : 32);
    if (exact) return;
    const QuantizeRows quantize = active_kernels().quantize;
    Activations* ap = &a;  // a thread_local of the caller must be reached through a pointer in the lambda
    if (rows >= 16)
        ov::parallel_for(size_t(rows), [ap, quantize](size_t m) { quantize(*ap, int64_t(m), int64_t(m) + 1); });
    else
        quantize(a, 0, rows);
}

void validate_product(const ov::Node* node, const std::string& block_type, const std::string& precision,
                      const ov::PartialShape& xs, const ov::PartialShape& ws, size_t blocks_input) {
    const std::string op = node->get_type_name();
    const Format* f = format_by_name(block_type.c_str());
    NODE_VALIDATION_CHECK(node, f != nullptr, op, ": block type '", block_type, "' is not one fleet's kernels run");
    NODE_VALIDATION_CHECK(node, precision == "int8" || precision == "f32", op, ": precision '", precision,
                          "' is neither int8 nor f32");
    NODE_VALIDATION_CHECK(node, node->get_input_element_type(0) == ov::element::f32, op, ": activations must be f32");
    NODE_VALIDATION_CHECK(node, node->get_input_element_type(blocks_input) == ov::element::u8, op, ": blocks must be u8");
    const auto& k = xs[xs.size() - 1];
    const auto& bytes = ws[ws.size() - 1];
    if (k.is_static() && bytes.is_static()) {
        const size_t want = row_bytes(*f, k.get_length());
        NODE_VALIDATION_CHECK(node, want != 0 && int64_t(want) == bytes.get_length(), op, ": ", block_type,
                              " rows of K = ", k.get_length(), " take ", want, " bytes, not ", bytes);
    }
}

void thread_rows(int64_t N, int ithr, int nthr, int64_t& n0, int64_t& n1) {
    const int64_t tiles = (N + 3) / 4;
    const int64_t t0 = tiles * ithr / nthr, t1 = tiles * (ithr + 1) / nthr;
    n0 = std::min(N, t0 * 4);
    n1 = std::min(N, t1 * 4);
}

void run_product(const Product& p) { run_products(&p, 1); }

void run_products(const Product* ps, size_t n) {
    RowsKernel kernels[8];
    std::vector<RowsKernel> more(n > 8 ? n : 0);
    RowsKernel* kernel = n > 8 ? more.data() : kernels;
    for (size_t i = 0; i < n; ++i) kernel[i] = select_kernel(ps[i]);
    // Contiguous ranges of tiles of 4 rows per thread of each product in turn: each thread streams its own part of
    // each tensor's blocks, and the threads wait for each other once.
    ov::parallel_nt_static(0, [&](const int ithr, const int nthr) {
        for (size_t i = 0; i < n; ++i) {
            int64_t n0, n1;
            thread_rows(ps[i].N, ithr, nthr, n0, n1);
            if (n0 < n1) kernel[i](ps[i], n0, n1);
        }
    });
}

}  // namespace fleet
