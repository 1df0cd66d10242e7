// fleet_gguf.GgufMoeMatMul: each token times its chosen experts' GGUF blocks, reading only those experts.
#pragma once

#include <openvino/op/op.hpp>

namespace fleet {

// Inputs: 0 activations f32 [T, K]; 1 the experts' bytes, a u8 Constant [E, N, K / block x block bytes]
// (a GGUF expert tensor as it lies: expert e's N rows); 2 the chosen experts, i32 or i64 [T, k].
// Output f32 [T, k, N]: token t times expert chosen[t, j]. Tokens are grouped by expert, so each chosen
// expert's blocks are read once per call whatever the number of tokens choosing it. An expert index
// outside [0, E) fails the inference naming it. Attributes as GgufMatMul's.
class GgufMoeMatMul : public ov::op::Op {
public:
    OPENVINO_OP("GgufMoeMatMul", "fleet_gguf");

    GgufMoeMatMul() = default;
    GgufMoeMatMul(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& blocks, const ov::Output<ov::Node>& chosen,
                  std::string block_type, std::string precision);

    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override;
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
    bool has_evaluate() const override { return true; }

private:
    std::string block_type_;
    std::string precision_ = "int8";
};

}  // namespace fleet
