#include "gguf_matmul.h"

#include "products.h"

namespace fleet {

GgufMatMul::GgufMatMul(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& blocks, std::string block_type,
                       std::string precision)
    : Op({x, blocks}), block_type_(std::move(block_type)), precision_(std::move(precision)) {
    constructor_validate_and_infer_types();
}

void GgufMatMul::validate_and_infer_types() {
    const auto& xs = get_input_partial_shape(0);
    const auto& ws = get_input_partial_shape(1);
    NODE_VALIDATION_CHECK(this, ws.rank().is_static() && ws.rank().get_length() == 2, "GgufMatMul: blocks [N, bytes]");
    NODE_VALIDATION_CHECK(this, xs.rank().is_static() && xs.rank().get_length() >= 1, "GgufMatMul: activations [..., K]");
    validate_product(this, block_type_, precision_, xs, ws);
    ov::PartialShape out = xs;
    out[out.size() - 1] = ws[0];
    set_output_type(0, ov::element::f32, out);
}

std::shared_ptr<ov::Node> GgufMatMul::clone_with_new_inputs(const ov::OutputVector& args) const {
    check_new_args_count(this, args);
    return std::make_shared<GgufMatMul>(args[0], args[1], block_type_, precision_);
}

bool GgufMatMul::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("block_type", block_type_);
    visitor.on_attribute("precision", precision_);
    return true;
}

bool GgufMatMul::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const ov::Tensor& x = inputs[0];
    const ov::Tensor& w = inputs[1];
    const ov::Shape xs = x.get_shape();
    const int64_t K = int64_t(xs.back());
    const int64_t M = int64_t(ov::shape_size(xs)) / std::max<int64_t>(K, 1);
    const int64_t N = int64_t(w.get_shape()[0]);
    ov::Shape ys = xs;
    ys.back() = size_t(N);
    outputs[0].set_shape(ys);

    Product p;
    p.fmt = format_by_name(block_type_.c_str());
    p.w = static_cast<const uint8_t*>(w.data());
    p.row_bytes = w.get_shape()[1];
    p.K = K;
    p.N = N;
    p.M = M;
    p.y = outputs[0].data<float>();
    p.ldy = N;
    p.exact = precision_ == "f32" || p.fmt->is_float;
    if (M == 0 || N == 0) return true;

    thread_local Activations activations;  // reused across calls: no allocation per decode step
    prepare_activations(activations, x.data<const float>(), M, K, *p.fmt, p.exact);
    p.a = &activations;
    run_product(p);
    return true;
}

}  // namespace fleet
