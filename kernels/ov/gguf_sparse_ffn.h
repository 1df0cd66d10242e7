// fleet_gguf.GgufSparseFfn: an FFN that computes only the neurons whose gate fires (PowerInfer's sparse FFN, on the
// GGUF blocks as they lie): the gate dense, up on the kept neurons, down as a sum of the kept rows of down_t.
#pragma once

#include <openvino/op/op.hpp>

namespace fleet {

// Inputs: 0 x f32 [..., d]; 1 gate and 2 up, u8 Constants [F, d / block x block bytes] (GGUF row-major, as
// GgufMatMul takes them: row i holds neuron i's d weights); 3 down_t, u8 [F, d / block x block bytes]: the down
// projection transposed, row i neuron i's output column of d weights (types Q8_0, Q4_0, F16, BF16, F32).
// Output y f32 [..., d]. For each row of x:
//   g = x gate^T, u = x up^T   the same kernels and bits as GgufMatMul of that row (precision int8 or f32)
//   a(g) = relu(g) or silu(g) = g / (1 + exp(-g)) (fleet's exp: core/sparse.h; the same bits on every CPU)
//   neuron i is kept iff |a(g_i)| > threshold (relu: g_i > threshold; FATReLU-style for threshold > 0)
//   h_i = a(g_i) u_i where kept, else exactly 0;  y = sum over kept i, ascending, of h_i down_t[i, :]
// (core/sparse.h defines the sum to the bit). up is computed only on the union of the rows' kept neurons, down_t
// read only on the kept rows; a row's y is the same bits whatever the number of rows and threads.
// Attributes: gate_type, up_type, down_t_type (GGUF's names), precision ("int8" or "f32"), activation ("relu" or
// "silu"), threshold (>= 0). A shape, type or attribute the op cannot run is refused by name at validation.
class GgufSparseFfn : public ov::op::Op {
public:
    OPENVINO_OP("GgufSparseFfn", "fleet_gguf");

    GgufSparseFfn() = default;
    GgufSparseFfn(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& gate, const ov::Output<ov::Node>& up,
                  const ov::Output<ov::Node>& down_t, std::string gate_type, std::string up_type, std::string down_t_type,
                  std::string precision, std::string activation, float threshold);

    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override;
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
    bool has_evaluate() const override { return true; }

private:
    void validate_weights(int64_t d);

    std::string gate_type_, up_type_, down_t_type_;
    std::string precision_ = "int8";
    std::string activation_ = "relu";
    float threshold_ = 0.0f;
};

}  // namespace fleet
