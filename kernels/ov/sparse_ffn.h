// What fleet_gguf.GgufSparseFfn runs: the gate dense with its mask, up on the kept neurons only, and the axpy over
// the kept rows of down_t (core/sparse.h), each step over the stage's threads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../core/product.h"

namespace fleet {

// One FFN's weights as GGUF blocks: gate [F, gate_bytes] and up [F, up_bytes] (rows of d weights, as GgufMatMul
// takes them), down_t [F, down_bytes] (row i: neuron i's output column of d weights, one of the axpy types).
struct SparseFfn {
    const Format *gate = nullptr, *up = nullptr, *down_t = nullptr;
    const uint8_t *wg = nullptr, *wu = nullptr, *wd = nullptr;
    size_t gate_bytes = 0, up_bytes = 0, down_bytes = 0;
    int64_t d = 0, F = 0;
    bool exact = false;  // precision f32: gate and up on the activations as they are (else int8, as GgufMatMul)
    GateActivation act = GateActivation::Relu;
    float threshold = 0.0f;  // >= 0
};

// y [M, d] f32 = the sparse FFN of x [M, d] f32 (GgufSparseFfn: gguf_sparse_ffn.h says what it computes). The
// threads of the calling arena split the gate's and up's rows and the axpy's columns; each row's result is the
// same bits whatever M and the thread count.
void run_sparse_ffn(const SparseFfn& f, const float* x, int64_t M, float* y);

}  // namespace fleet
