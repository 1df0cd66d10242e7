// The sparse FFN's kernels (core/sparse.h) of every instruction set this CPU runs against the scalar ones: the
// gate's activation and the axpy must give the same bits (the same float operations in the same order), and each
// row of an axpy the same bits alone as in a batch, where other rows keep neurons it drops (an infinite weight
// among them). Also fleet_exp against the double exp. Part of kernels_check (check.cpp).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "product.h"

using namespace fleet;

namespace {

// fleet_exp within 2 ulp of e^x on [kExpLo, kExpHi]: over a grid and at the ends.
int exp_failures(int& checks) {
    double worst = 0.0;
    for (int i = 0; i <= 2000000; ++i) {
        const float x = kExpLo + (kExpHi - kExpLo) * float(i) / 2000000.0f;
        const double want = std::exp(double(x));
        const double ulp = std::ldexp(1.0, std::ilogb(float(want)) - 23);
        worst = std::max(worst, std::fabs(double(fleet_exp(x)) - want) / ulp);
    }
    ++checks;
    const bool silu_ok = fleet_silu(100.0f) == 100.0f && fleet_silu(-100.0f) <= 0.0f && fleet_silu(-100.0f) > -1e-35f &&
                         std::isnan(fleet_silu(std::numeric_limits<float>::quiet_NaN())) && fleet_silu(0.0f) == 0.0f;
    if (worst <= 2.0 && silu_ok) return 0;
    std::printf("FAIL fleet_exp: %.2f ulp from exp (at most 2), silu's limits %s\n", worst, silu_ok ? "right" : "wrong");
    return 1;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
        if (!(std::isnan(a[i]) && std::isnan(b[i])) && std::memcmp(&a[i], &b[i], 4) != 0) return false;
    return true;
}

int activate_failures(const KernelTable& t, std::mt19937& g, int& checks) {
    int failures = 0;
    std::normal_distribution<float> nd(0.0f, 4.0f);
    const float special[] = {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN(), 1e30f, -1e30f, 1e-40f, 87.5f, -88.5f, 0.3f};
    for (int64_t n : {1, 7, 32, 33, 100, 1000})
        for (GateActivation act : {GateActivation::Relu, GateActivation::Silu})
            for (float threshold : {0.0f, 0.3f, 2.0f}) {
                std::vector<float> want(static_cast<size_t>(n)), got;
                for (auto& v : want) v = nd(g);
                for (size_t i = 0; i < sizeof special / sizeof *special && i < size_t(n); ++i) want[i * 3 % n] = special[i];
                got = want;
                std::vector<uint8_t> keep_want(static_cast<size_t>(n)), keep_got(static_cast<size_t>(n));
                scalar_kernels().activate(act, threshold, want.data(), keep_want.data(), n);
                t.activate(act, threshold, got.data(), keep_got.data(), n);
                ++checks;
                if (!same_bits(want, got) || keep_want != keep_got) {
                    std::printf("FAIL %s activate act=%d threshold=%g n=%ld\n", t.isa, int(act), double(threshold), long(n));
                    ++failures;
                }
            }
    return failures;
}

// down_t [F, D] of type f: random codes with f16 scales in [0.002, 0.02], or N(0, 1) floats; one weight of the last
// row infinite where the type can hold it (a float type), so that a row not keeping that neuron must skip it.
std::vector<uint8_t> random_down_t(const Format& f, int64_t F, int64_t D, std::mt19937& g) {
    std::vector<uint8_t> w(row_bytes(f, D) * size_t(F));
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> scale(0.002f, 0.02f);
    for (auto& b : w) b = uint8_t(g());
    for (int64_t i = 0; i < (f.is_float ? F * D : int64_t(w.size()) / f.bytes); ++i) {
        const float v = f.is_float ? nd(g) : scale(g);
        if (f.type == BlockType::F32) {
            std::memcpy(&w[size_t(i) * 4], &v, 4);
        } else {
            uint16_t bits;
            if (f.type == BlockType::BF16) { uint32_t u; std::memcpy(&u, &v, 4); bits = uint16_t(u >> 16); }
            else { const _Float16 h = _Float16(v); std::memcpy(&bits, &h, 2); }
            std::memcpy(&w[size_t(i) * (f.is_float ? 2 : f.bytes)], &bits, 2);
        }
    }
    if (f.is_float) {
        const float inf = std::numeric_limits<float>::infinity();
        uint8_t* last = &w[row_bytes(f, D) * size_t(F - 1)];
        const uint16_t inf16 = f.type == BlockType::F16 ? 0x7c00 : 0x7f80;  // F16's and BF16's infinity
        std::memcpy(last, f.type == BlockType::F32 ? static_cast<const void*>(&inf) : &inf16, f.type == BlockType::F32 ? 4 : 2);
    }
    return w;
}

struct AxpyCase {
    const Format* f;
    std::vector<uint8_t> w;
    int64_t F, D, M;
    std::vector<int32_t> U;
    std::vector<float> h;
    std::vector<uint8_t> keep;
};

// y of a case by `kernel`, its columns in two ranges split at a block (as two threads take them).
std::vector<float> run_axpy(AxpyKernel kernel, const AxpyCase& c, int64_t M, const int32_t* U, int64_t count,
                            const float* h, const uint8_t* keep) {
    std::vector<float> y(size_t(M * c.D), -1.0f);
    SparseAxpy p;
    p.fmt = c.f; p.w = c.w.data(); p.row_bytes = row_bytes(*c.f, c.D); p.D = c.D; p.M = M;
    p.neurons = U; p.count = count; p.h = h; p.keep = keep; p.y = y.data(); p.ldy = c.D;
    const int64_t unit = c.f->is_float ? 8 : 32, half = std::min(c.D, (c.D / unit / 2) * unit);
    kernel(p, 0, half);
    kernel(p, half, c.D);
    return y;
}

// Row m alone: its own kept neurons as the union, every one kept.
std::vector<float> alone(AxpyKernel kernel, const AxpyCase& c, int64_t m) {
    std::vector<int32_t> U;
    std::vector<float> h;
    for (size_t k = 0; k < c.U.size(); ++k)
        if (c.keep[size_t(m) * c.U.size() + k]) { U.push_back(c.U[k]); h.push_back(c.h[size_t(m) * c.U.size() + k]); }
    return run_axpy(kernel, c, 1, U.data(), int64_t(U.size()), h.data(), nullptr);
}

AxpyCase random_case(const Format& f, int64_t F, int64_t D, int64_t M, std::mt19937& g) {
    AxpyCase c{&f, random_down_t(f, F, D, g), F, D, M, {}, {}, {}};
    for (int32_t i = 0; i < F; ++i)
        if (g() % 4 != 0 || i == F - 1) c.U.push_back(i);  // a union with gaps, holding the infinite row
    std::normal_distribution<float> nd;
    const size_t count = c.U.size();
    c.h.resize(size_t(M) * count);
    c.keep.resize(size_t(M) * count);
    for (size_t i = 0; i < c.h.size(); ++i) {
        c.h[i] = nd(g);
        c.keep[i] = g() % 2;
    }
    c.keep[count - 1] = 0;  // row 0 drops the neuron with the infinite weight
    return c;
}

}  // namespace

int axpy_failures(const KernelTable& t, std::mt19937& g, int& checks) {
    int failures = 0;
    for (const char* name : {"Q8_0", "Q4_0", "F16", "BF16", "F32"}) {
        const Format& f = *format_by_name(name);
        const int id = int(f.type);
        for (int64_t D : {32, 96, 2080, 8, 67, 1029}) {
            if (!f.is_float && D % 32) continue;
            for (int64_t F : {1, 5, 70})
                for (int64_t M : {1, 3, 5, 9}) {
                    const AxpyCase c = random_case(f, F, D, M, g);
                    const int64_t count = int64_t(c.U.size());
                    const auto want = run_axpy(scalar_kernels().axpy[id], c, M, c.U.data(), count, c.h.data(), c.keep.data());
                    const auto got = run_axpy(t.axpy[id], c, M, c.U.data(), count, c.h.data(), c.keep.data());
                    ++checks;
                    if (!same_bits(want, got)) {
                        std::printf("FAIL %s axpy %s D=%ld F=%ld M=%ld differs from the scalar one\n", t.isa, name, long(D),
                                    long(F), long(M));
                        ++failures;
                    }
                    for (int64_t m = 0; m < M; ++m) {
                        const auto one = alone(t.axpy[id], c, m);
                        const std::vector<float> row(got.begin() + m * D, got.begin() + (m + 1) * D);
                        if (!same_bits(one, row) || (m == 0 && !std::isfinite(row[0]) && f.is_float)) {
                            std::printf("FAIL %s axpy %s D=%ld F=%ld row %ld alone differs from the batch\n", t.isa, name,
                                        long(D), long(F), long(m));
                            ++failures;
                        }
                    }
                }
        }
    }
    return failures;
}

// Every sparse kernel of the given tables against the scalar ones; fleet_exp's accuracy. Returns the failures.
int sparse_failures(const std::vector<const KernelTable*>& isas, std::mt19937& g, int& checks) {
    int failures = exp_failures(checks);
    for (const KernelTable* t : isas) failures += activate_failures(*t, g, checks) + axpy_failures(*t, g, checks);
    // the scalar axpy's rows alone against its batches too
    failures += axpy_failures(scalar_kernels(), g, checks);
    return failures;
}
