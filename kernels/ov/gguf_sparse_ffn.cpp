#include "gguf_sparse_ffn.h"

#include "sparse_ffn.h"

namespace fleet {

namespace {

const char* const kWeights[3] = {"gate", "up", "down_t"};

}  // namespace

GgufSparseFfn::GgufSparseFfn(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& gate, const ov::Output<ov::Node>& up,
                             const ov::Output<ov::Node>& down_t, std::string gate_type, std::string up_type,
                             std::string down_t_type, std::string precision, std::string activation, float threshold)
    : Op({x, gate, up, down_t}),
      gate_type_(std::move(gate_type)),
      up_type_(std::move(up_type)),
      down_t_type_(std::move(down_t_type)),
      precision_(std::move(precision)),
      activation_(std::move(activation)),
      threshold_(threshold) {
    constructor_validate_and_infer_types();
}

// The three weights: known types (down_t one the axpy runs), u8 [F, bytes] with one F, rows of d weights.
void GgufSparseFfn::validate_weights(int64_t d) {
    const std::string types[3] = {gate_type_, up_type_, down_t_type_};
    ov::Dimension F = ov::Dimension::dynamic();
    for (int w = 0; w < 3; ++w) {
        const char* name = kWeights[w];
        const Format* f = format_by_name(types[w].c_str());
        NODE_VALIDATION_CHECK(this, f != nullptr, "GgufSparseFfn: ", name, " type '", types[w], "' is not one fleet's kernels run");
        NODE_VALIDATION_CHECK(this, w < 2 || is_axpy_type(f->type), "GgufSparseFfn: down_t type '", types[w],
                              "' is not one the sparse axpy runs (", kAxpyTypes, ")");
        NODE_VALIDATION_CHECK(this, get_input_element_type(w + 1) == ov::element::u8, "GgufSparseFfn: ", name,
                              " must be u8 blocks, not ", get_input_element_type(w + 1));
        const auto& ws = get_input_partial_shape(w + 1);
        NODE_VALIDATION_CHECK(this, ws.rank().is_static() && ws.rank().get_length() == 2, "GgufSparseFfn: ", name,
                              " must be blocks [F, bytes], not ", ws);
        NODE_VALIDATION_CHECK(this, ov::Dimension::merge(F, F, ws[0]), "GgufSparseFfn: gate, up and down_t must have the same F rows (",
                              get_input_partial_shape(1)[0], ", ", get_input_partial_shape(2)[0], ", ",
                              get_input_partial_shape(3)[0], ")");
        if (d < 0) continue;  // d dynamic: checked when known
        NODE_VALIDATION_CHECK(this, d % f->block == 0, "GgufSparseFfn: d = ", d, " is not a multiple of ", types[w],
                              "'s block of ", f->block, " weights (", name, ")");
        const size_t want = row_bytes(*f, d);
        NODE_VALIDATION_CHECK(this, ws[1].is_dynamic() || int64_t(want) == ws[1].get_length(), "GgufSparseFfn: ", name,
                              "'s ", types[w], " rows of d = ", d, " take ", want, " bytes, not ", ws[1]);
    }
}

void GgufSparseFfn::validate_and_infer_types() {
    NODE_VALIDATION_CHECK(this, precision_ == "int8" || precision_ == "f32", "GgufSparseFfn: precision '", precision_,
                          "' is neither int8 nor f32");
    NODE_VALIDATION_CHECK(this, activation_ == "relu" || activation_ == "silu", "GgufSparseFfn: activation '", activation_,
                          "' is neither relu nor silu");
    NODE_VALIDATION_CHECK(this, threshold_ >= 0.0f, "GgufSparseFfn: threshold ", threshold_,
                          " is not >= 0 (a neuron is kept where |a(gate)| > threshold)");
    NODE_VALIDATION_CHECK(this, get_input_element_type(0) == ov::element::f32, "GgufSparseFfn: x must be f32, not ",
                          get_input_element_type(0));
    const auto& xs = get_input_partial_shape(0);
    NODE_VALIDATION_CHECK(this, xs.rank().is_static() && xs.rank().get_length() >= 1, "GgufSparseFfn: x must be [..., d], not ", xs);
    const auto& d = xs[xs.size() - 1];
    validate_weights(d.is_static() ? d.get_length() : -1);
    set_output_type(0, ov::element::f32, xs);
}

std::shared_ptr<ov::Node> GgufSparseFfn::clone_with_new_inputs(const ov::OutputVector& args) const {
    check_new_args_count(this, args);
    return std::make_shared<GgufSparseFfn>(args[0], args[1], args[2], args[3], gate_type_, up_type_, down_t_type_,
                                           precision_, activation_, threshold_);
}

bool GgufSparseFfn::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("gate_type", gate_type_);
    visitor.on_attribute("up_type", up_type_);
    visitor.on_attribute("down_t_type", down_t_type_);
    visitor.on_attribute("precision", precision_);
    visitor.on_attribute("activation", activation_);
    visitor.on_attribute("threshold", threshold_);
    return true;
}

bool GgufSparseFfn::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const ov::Tensor& x = inputs[0];
    const ov::Shape xs = x.get_shape();
    outputs[0].set_shape(xs);
    SparseFfn f;
    f.gate = format_by_name(gate_type_.c_str());
    f.up = format_by_name(up_type_.c_str());
    f.down_t = format_by_name(down_t_type_.c_str());
    f.wg = static_cast<const uint8_t*>(inputs[1].data());
    f.wu = static_cast<const uint8_t*>(inputs[2].data());
    f.wd = static_cast<const uint8_t*>(inputs[3].data());
    f.gate_bytes = inputs[1].get_shape()[1];
    f.up_bytes = inputs[2].get_shape()[1];
    f.down_bytes = inputs[3].get_shape()[1];
    f.d = int64_t(xs.back());
    f.F = int64_t(inputs[1].get_shape()[0]);
    f.exact = precision_ == "f32";
    f.act = activation_ == "silu" ? GateActivation::Silu : GateActivation::Relu;
    f.threshold = threshold_;
    const int64_t M = f.d == 0 ? 0 : int64_t(ov::shape_size(xs)) / f.d;
    if (M == 0) return true;
    run_sparse_ffn(f, x.data<const float>(), M, outputs[0].data<float>());
    return true;
}

}  // namespace fleet
