// What the ops share: quantizing a product's activations and running it over the stage's threads.
#pragma once

#include <openvino/core/node.hpp>
#include <string>

#include "../core/product.h"

namespace fleet {

// Points `a` at x [rows, K] and quantizes it unless `exact` (rows split over threads when there are many), per
// 256 values for the 256-weight types of `f`, else per 32.
void prepare_activations(Activations& a, const float* x, int64_t rows, int64_t K, const Format& f, bool exact);

// The checks GgufMatMul and GgufMoeMatMul share: a block type the kernels run, precision int8 or f32, f32
// activations xs [..., K] (input 0) and u8 blocks ws [..., row bytes] (input `blocks_input`) whose rows hold K
// weights of that type. The ops check their own ranks first. Errors name the op (NODE_VALIDATION_CHECK).
void validate_product(const ov::Node* node, const std::string& block_type, const std::string& precision,
                      const ov::PartialShape& xs, const ov::PartialShape& ws, size_t blocks_input = 1);

// The contiguous range [n0, n1) of N output rows that thread ithr of nthr takes: whole tiles of 4 rows each (the
// split run_product makes; the sparse FFN splits its gate and up rows the same way).
void thread_rows(int64_t N, int ithr, int nthr, int64_t& n0, int64_t& n1);

// Runs `p` (kernel from the chosen instruction set) with the output rows split into one contiguous range
// per thread of the calling arena (INFERENCE_NUM_THREADS).
void run_product(const Product& p);
// Runs products ps[0 .. n) in one parallel region: each thread takes its range of each product's rows in turn (the
// same ranges, and so the same bits, as run_product of each).
void run_products(const Product* ps, size_t n);

}  // namespace fleet
