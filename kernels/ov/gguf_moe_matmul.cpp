#include "gguf_moe_matmul.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "products.h"

namespace fleet {

GgufMoeMatMul::GgufMoeMatMul(const ov::Output<ov::Node>& x, const ov::Output<ov::Node>& blocks,
                             const ov::Output<ov::Node>& chosen, std::string block_type, std::string precision)
    : Op({x, blocks, chosen}), block_type_(std::move(block_type)), precision_(std::move(precision)) {
    constructor_validate_and_infer_types();
}

void GgufMoeMatMul::validate_and_infer_types() {
    const auto ct = get_input_element_type(2);
    NODE_VALIDATION_CHECK(this, ct == ov::element::i32 || ct == ov::element::i64, "GgufMoeMatMul: chosen must be i32 or i64");
    const auto& xs = get_input_partial_shape(0);
    const auto& ws = get_input_partial_shape(1);
    const auto& cs = get_input_partial_shape(2);
    NODE_VALIDATION_CHECK(this, xs.rank().is_static() && xs.rank().get_length() == 2, "GgufMoeMatMul: activations [T, K]");
    NODE_VALIDATION_CHECK(this, ws.rank().is_static() && ws.rank().get_length() == 3, "GgufMoeMatMul: blocks [E, N, bytes]");
    NODE_VALIDATION_CHECK(this, cs.rank().is_static() && cs.rank().get_length() == 2, "GgufMoeMatMul: chosen [T, k]");
    validate_product(this, block_type_, precision_, xs, ws);
    set_output_type(0, ov::element::f32, ov::PartialShape{xs[0], cs[1], ws[1]});
}

std::shared_ptr<ov::Node> GgufMoeMatMul::clone_with_new_inputs(const ov::OutputVector& args) const {
    check_new_args_count(this, args);
    return std::make_shared<GgufMoeMatMul>(args[0], args[1], args[2], block_type_, precision_);
}

bool GgufMoeMatMul::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("block_type", block_type_);
    visitor.on_attribute("precision", precision_);
    return true;
}

bool GgufMoeMatMul::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const ov::Tensor& x = inputs[0];
    const ov::Tensor& w = inputs[1];
    const ov::Tensor& chosen = inputs[2];
    const int64_t T = int64_t(x.get_shape()[0]), K = int64_t(x.get_shape()[1]);
    const int64_t E = int64_t(w.get_shape()[0]), N = int64_t(w.get_shape()[1]);
    const int64_t k = int64_t(chosen.get_shape()[1]);
    outputs[0].set_shape({size_t(T), size_t(k), size_t(N)});
    const bool wide = chosen.get_element_type() == ov::element::i64;
    auto expert_of = [&](int64_t i) { return wide ? chosen.data<const int64_t>()[i] : chosen.data<const int32_t>()[i]; };
    // Tokens grouped by expert: (row of x, row of the output) per use.
    std::vector<std::vector<std::pair<int64_t, int64_t>>> uses(static_cast<size_t>(E));
    for (int64_t i = 0; i < T * k; ++i) {
        const int64_t e = expert_of(i);
        if (e < 0 || e >= E)
            throw std::out_of_range("GgufMoeMatMul: expert " + std::to_string(e) + " is outside [0, " + std::to_string(E) + ")");
        uses[size_t(e)].emplace_back(i / k, i);
    }
    Product p;
    p.fmt = format_by_name(block_type_.c_str());
    p.row_bytes = w.get_shape()[2];
    p.K = K;
    p.N = N;
    p.ldy = N;
    p.exact = precision_ == "f32" || p.fmt->is_float;
    const uint8_t* base = static_cast<const uint8_t*>(w.data());
    const float* xs = x.data<const float>();
    float* y = outputs[0].data<float>();
    thread_local std::vector<float> rows, out;
    thread_local Activations activations;
    for (int64_t e = 0; e < E; ++e) {
        const auto& list = uses[size_t(e)];
        if (list.empty()) continue;
        const int64_t M = int64_t(list.size());
        rows.resize(size_t(M * K));
        out.resize(size_t(M * N));
        for (int64_t m = 0; m < M; ++m) std::memcpy(&rows[size_t(m * K)], xs + list[size_t(m)].first * K, size_t(K) * 4);
        prepare_activations(activations, rows.data(), M, K, *p.fmt, p.exact);
        p.w = base + size_t(e) * size_t(N) * p.row_bytes;
        p.M = M;
        p.a = &activations;
        p.y = out.data();
        run_product(p);
        for (int64_t m = 0; m < M; ++m) std::memcpy(y + list[size_t(m)].second * N, &out[size_t(m * N)], size_t(N) * 4);
    }
    return true;
}

}  // namespace fleet
