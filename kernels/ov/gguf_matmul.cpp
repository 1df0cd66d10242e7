#include "gguf_matmul.h"

#include "products.h"

namespace fleet {

GgufMatMul::GgufMatMul(const ov::OutputVector& args, std::string block_type, std::string precision)
    : Op(args), block_type_(std::move(block_type)), precision_(std::move(precision)) {
    constructor_validate_and_infer_types();
}

namespace {

std::vector<std::string> split_types(const std::string& block_type) {
    std::vector<std::string> out;
    size_t start = 0;
    for (size_t comma; (comma = block_type.find(',', start)) != std::string::npos; start = comma + 1)
        out.push_back(block_type.substr(start, comma - start));
    out.push_back(block_type.substr(start));
    return out;
}

}  // namespace

void GgufMatMul::validate_and_infer_types() {
    const auto& xs = get_input_partial_shape(0);
    const size_t n = get_input_size() - 1;
    const std::vector<std::string> block_types = split_types(block_type_);
    NODE_VALIDATION_CHECK(this, n >= 1, "GgufMatMul: activations and at least one tensor's blocks");
    NODE_VALIDATION_CHECK(this, block_types.size() == n, "GgufMatMul: ", n, " tensors but ", block_types.size(),
                          " block types in '", block_type_, "'");
    NODE_VALIDATION_CHECK(this, xs.rank().is_static() && xs.rank().get_length() >= 1, "GgufMatMul: activations [..., K]");
    formats_.clear();
    for (size_t i = 0; i < n; ++i) {
        const auto& ws = get_input_partial_shape(i + 1);
        NODE_VALIDATION_CHECK(this, ws.rank().is_static() && ws.rank().get_length() == 2, "GgufMatMul: blocks [N, bytes]");
        validate_product(this, block_types[i], precision_, xs, ws, i + 1);
        ov::PartialShape out = xs;
        out[out.size() - 1] = ws[0];
        set_output_type(i, ov::element::f32, out);
        formats_.push_back(format_by_name(block_types[i].c_str()));
    }
}

std::shared_ptr<ov::Node> GgufMatMul::clone_with_new_inputs(const ov::OutputVector& args) const {
    return std::make_shared<GgufMatMul>(args, block_type_, precision_);
}

bool GgufMatMul::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("block_type", block_type_);
    visitor.on_attribute("precision", precision_);
    return true;
}

bool GgufMatMul::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const ov::Tensor& x = inputs[0];
    const ov::Shape xs = x.get_shape();
    const int64_t K = int64_t(xs.back());
    const int64_t M = int64_t(ov::shape_size(xs)) / std::max<int64_t>(K, 1);
    const size_t n = formats_.size();

    // Activations in each form the tensors take (per 32, per 256, exact), prepared once: thread_local, so reused
    // across calls with no allocation per decode step.
    thread_local Activations forms[3];
    bool prepared[3] = {false, false, false};
    // A step's products without allocating: a layer's ops have 1-3 tensors.
    Product few[4];
    std::vector<Product> many(n > 4 ? n : 0);
    Product* products = n > 4 ? many.data() : few;
    for (size_t i = 0; i < n; ++i) {
        const ov::Tensor& w = inputs[i + 1];
        const int64_t N = int64_t(w.get_shape()[0]);
        ov::Shape ys = xs;
        ys.back() = size_t(N);
        outputs[i].set_shape(ys);
        Product& p = products[i];
        p.fmt = formats_[i];
        p.w = static_cast<const uint8_t*>(w.data());
        p.row_bytes = w.get_shape()[1];
        p.K = K;
        p.N = N;
        p.M = M;
        p.y = outputs[i].data<float>();
        p.ldy = N;
        p.exact = precision_ == "f32" || p.fmt->is_float;
        const int form = p.exact ? 2 : p.fmt->block == 256 ? 1 : 0;
        if (M > 0 && !prepared[form]) {
            prepare_activations(forms[form], x.data<const float>(), M, K, *p.fmt, p.exact);
            prepared[form] = true;
        }
        p.a = &forms[form];
    }
    if (M > 0) run_products(products, n);
    return true;
}

}  // namespace fleet
