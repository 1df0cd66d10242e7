// fleet_gguf.GgufMatMul: activations [..., K] f32 times one GGUF tensor's blocks, as they lie in the file.
#pragma once

#include <openvino/op/op.hpp>

namespace fleet {

struct Format;

// Inputs: 0 activations f32 [..., K]; 1 the tensor's bytes, a u8 Constant [N, K / block x block bytes]
// (GGUF row-major: row n holds output n's K weights). Output f32 [..., N].
// Attributes: block_type (GGUF's name: "Q4_K", "F16", ...); precision "int8" (activations quantized to
// int8 per 32, the default: llama.cpp's speed) or "f32" (exact: the activations as they are).
class GgufMatMul : public ov::op::Op {
public:
    OPENVINO_OP("GgufMatMul", "fleet_gguf");

    GgufMatMul() = default;
    GgufMatMul(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& blocks, std::string block_type,
               std::string precision);

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
