// What the ops share: quantizing a product's activations and running it over the stage's threads.
#pragma once

#include "../core/product.h"

namespace fleet {

// Points `a` at x [rows, K] and quantizes it unless p.exact (rows split over threads when there are many).
void prepare_activations(Activations& a, const float* x, int64_t rows, int64_t K, bool exact);

// Runs `p` (kernel from the chosen instruction set) with the output rows split into one contiguous range
// per thread of the calling arena (INFERENCE_NUM_THREADS).
void run_product(const Product& p);

}  // namespace fleet
