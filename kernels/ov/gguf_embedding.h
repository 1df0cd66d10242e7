// fleet_gguf.GgufEmbedding: rows of an embedding table taken from its GGUF blocks (token_embd kept as in the file).
#pragma once

#include <openvino/op/op.hpp>

namespace fleet {

// Inputs: 0 the table's bytes, a u8 Constant [V, K / block x block bytes] (GGUF row-major, one row a token);
// 1 token ids i32 or i64 [...]. Output f32 [..., K]: each id's row, dequantized (fma(s, c, o) per weight,
// exactly the values GgufMatMul's f32 precision multiplies). An id outside [0, V) fails the inference
// naming it. Attribute: block_type.
class GgufEmbedding : public ov::op::Op {
public:
    OPENVINO_OP("GgufEmbedding", "fleet_gguf");

    GgufEmbedding() = default;
    GgufEmbedding(const ov::Output<ov::Node>& blocks, const ov::Output<ov::Node>& ids, std::string block_type);

    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override;
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
    bool has_evaluate() const override { return true; }

private:
    std::string block_type_;
};

}  // namespace fleet
