#include "gguf_embedding.h"

#include <openvino/core/parallel.hpp>
#include <stdexcept>
#include <string>

#include "../core/formats.h"

namespace fleet {

GgufEmbedding::GgufEmbedding(const ov::Output<ov::Node>& blocks, const ov::Output<ov::Node>& ids, std::string block_type)
    : Op({blocks, ids}), block_type_(std::move(block_type)) {
    constructor_validate_and_infer_types();
}

void GgufEmbedding::validate_and_infer_types() {
    const Format* f = format_by_name(block_type_.c_str());
    NODE_VALIDATION_CHECK(this, f != nullptr, "GgufEmbedding: block type '", block_type_, "' is not one fleet's kernels run");
    NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::u8, "GgufEmbedding: the table must be u8");
    const auto ids = get_input_element_type(1);
    NODE_VALIDATION_CHECK(this, ids == ov::element::i32 || ids == ov::element::i64, "GgufEmbedding: ids must be i32 or i64");
    const auto& ws = get_input_partial_shape(0);
    NODE_VALIDATION_CHECK(this, ws.rank().is_static() && ws.rank().get_length() == 2, "GgufEmbedding: table [V, bytes]");
    NODE_VALIDATION_CHECK(this, ws[1].is_static() && ws[1].get_length() % f->bytes == 0, "GgufEmbedding: ", block_type_,
                          " rows are whole blocks of ", f->bytes, " bytes, not ", ws[1]);
    ov::PartialShape out = get_input_partial_shape(1);
    const int64_t cols = ws[1].get_length() / f->bytes * f->block;
    if (out.rank().is_static()) {
        std::vector<ov::Dimension> dims(out.begin(), out.end());
        dims.emplace_back(cols);
        out = ov::PartialShape(dims);
    } else {
        out = ov::PartialShape::dynamic();
    }
    set_output_type(0, ov::element::f32, out);
}

std::shared_ptr<ov::Node> GgufEmbedding::clone_with_new_inputs(const ov::OutputVector& args) const {
    check_new_args_count(this, args);
    return std::make_shared<GgufEmbedding>(args[0], args[1], block_type_);
}

bool GgufEmbedding::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("block_type", block_type_);
    return true;
}

bool GgufEmbedding::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const Format& f = *format_by_name(block_type_.c_str());
    const ov::Tensor& table = inputs[0];
    const ov::Tensor& ids = inputs[1];
    const int64_t vocab = int64_t(table.get_shape()[0]), bytes = int64_t(table.get_shape()[1]);
    const int64_t cols = bytes / f.bytes * f.block;
    ov::Shape ys = ids.get_shape();
    ys.push_back(size_t(cols));
    outputs[0].set_shape(ys);
    const int64_t count = int64_t(ids.get_size());
    const bool wide = ids.get_element_type() == ov::element::i64;
    const uint8_t* base = static_cast<const uint8_t*>(table.data());
    float* y = outputs[0].data<float>();
    for (int64_t i = 0; i < count; ++i) {  // checked before any row is read
        const int64_t id = wide ? ids.data<const int64_t>()[i] : ids.data<const int32_t>()[i];
        if (id < 0 || id >= vocab)
            throw std::out_of_range("GgufEmbedding: token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                    std::to_string(vocab) + ")");
    }
    ov::parallel_for(size_t(count), [&](size_t i) {
        const int64_t id = wide ? ids.data<const int64_t>()[i] : ids.data<const int32_t>()[i];
        dequantize_row(f, base + id * bytes, cols, y + int64_t(i) * cols);
    });
    return true;
}

}  // namespace fleet
