// fleet_gguf.GgufMatMul: activations [..., K] f32 times one or more GGUF tensors' blocks, as they lie in the file.
#pragma once

#include <openvino/op/op.hpp>
#include <vector>

namespace fleet {

struct Format;

// Inputs: 0 activations f32 [..., K]; 1 .. n the tensors' bytes, u8 Constants [N_i, K / block x block bytes]
// (GGUF row-major: row n holds output n's K weights). Outputs: n, f32 [..., N_i].
// Attributes: block_type, the n tensors' GGUF type names comma-separated ("Q4_K", or "Q4_K,Q4_K,Q6_K" for a layer's
// q, k and v); precision "int8" (activations quantized to int8 per 32, the default: llama.cpp's speed) or "f32"
// (exact: the activations as they are).
// Several tensors of one input are one op so that a decode step pays one op and one wait of the threads for them
// instead of one each (the products and their bits are those of separate ops).
class GgufMatMul : public ov::op::Op {
public:
    OPENVINO_OP("GgufMatMul", "fleet_gguf");

    GgufMatMul() = default;
    GgufMatMul(const ov::OutputVector& args, std::string block_type, std::string precision);

    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override;
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
    bool has_evaluate() const override { return true; }

private:
    std::string block_type_;
    std::string precision_ = "int8";
    std::vector<const Format*> formats_;  // block_type_'s, parsed once by validate_and_infer_types (not per step)
};

}  // namespace fleet
