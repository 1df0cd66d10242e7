// One build of fleet's kernels behind a C entry point, for bench/kernels/kernel_ab.py: the seconds one product
// takes on this build's fastest instruction set, one thread. Built against one revision's kernels/core, as a
// shared library of its own, so that two revisions load side by side in one process (alternate.cpp).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "product.h"

using namespace fleet;

namespace {

struct Case {  // the weights, activations and output of one (type, n, k, rows)
    std::vector<uint8_t> w;
    std::vector<float> x;  // the activations read (exact mode, float types) and quantized
    Activations a;
    std::vector<float> y;
    Product p;
    RowsKernel kernel = nullptr;
};

// Random blocks with every f16 scale set to 2^-7 (random bytes there could be NaN or infinity): the kernels' time
// does not depend on the values, only finite ones keep the float units at full speed.
void fill_blocks(const Format& f, std::vector<uint8_t>& w, std::mt19937& rng) {
    for (auto& b : w) b = uint8_t(rng());
    std::vector<int> f16_at;  // byte offsets of a block's f16 fields (formats.cpp's layouts)
    const std::string name = f.name;
    if (name == "Q4_K" || name == "Q5_K" || name == "Q4_1" || name == "Q5_1") f16_at = {0, 2};
    else if (name == "Q6_K") f16_at = {208};
    else if (name == "Q3_K") f16_at = {108};
    else if (name == "Q2_K") f16_at = {80, 82};
    else if (name == "MXFP4") f16_at = {};
    else f16_at = {0};
    for (size_t b = 0; b < w.size() / f.bytes; ++b)
        for (int at : f16_at) { w[b * f.bytes + at] = 0x00; w[b * f.bytes + at + 1] = 0x20; }
    if (name == "MXFP4")
        for (size_t b = 0; b < w.size() / f.bytes; ++b) w[b * f.bytes] = uint8_t(118 + rng() % 12);
}

}  // namespace

// Seconds of one product y[rows, n] = x[rows, k] w[n, k]^T of `type` (activations quantized, as the kernels' default
// precision runs them), the best of `reps` back to back; 0 when the type is unknown or k is not a whole number
// of its blocks. The first call for a (type, n, k, rows) prepares its data.
extern "C" __attribute__((visibility("default"))) double fleet_ab_seconds(const char* type, long n, long k, long rows,
                                                                           int reps) {
    static std::map<std::string, Case*> cases;
    const Format* f = format_by_name(type);
    if (f == nullptr || k % f->block != 0) return 0.0;
    Case*& c = cases[std::string(type) + ":" + std::to_string(n) + ":" + std::to_string(k) + ":" + std::to_string(rows)];
    if (c == nullptr) {
        c = new Case;
        std::mt19937 rng(1);
        c->w.resize(row_bytes(*f, k) * size_t(n));
        fill_blocks(*f, c->w, rng);
        c->x.resize(size_t(rows * k));
        std::normal_distribution<float> normal;
        for (auto& v : c->x) v = normal(rng);
        prepare(c->a, c->x.data(), rows, k, true, f->block == 256 ? 256 : 32);
        const KernelTable& table = active_kernels();
        table.quantize(c->a, 0, rows);
        c->y.resize(size_t(rows * n));
        Product& p = c->p;
        p.fmt = f; p.w = c->w.data(); p.row_bytes = row_bytes(*f, k); p.K = k; p.N = n; p.M = rows;
        p.a = &c->a; p.y = c->y.data(); p.ldy = n;
        c->kernel = f->is_float ? table.exact[int(f->type)] : table.quantized[int(f->type)];
    }
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        c->kernel(c->p, 0, n);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
}
