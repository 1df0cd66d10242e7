// Every kernel of every instruction set this CPU runs against the scalar one, outside OpenVINO: the
// sanitizers' test (tests/unit/test_kernels_sanitized.py builds this with ASan and UBSan and runs it).
// Random blocks of every type (finite scales), odd shapes, several row counts, both modes; each product
// split in two column ranges as two threads would; checks agreement (relative L2 <= 1e-5 to the scalar
// kernel) and that every row is bitwise the same computed alone. Exit status 1 on any failure.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "product.h"

using namespace fleet;

// check_sparse.cpp: the sparse FFN's kernels of these tables against the scalar ones; returns the failures.
int sparse_failures(const std::vector<const KernelTable*>& isas, std::mt19937& g, int& checks);

namespace {

struct Scales { const char* type; int offsets[2]; int count; };
const Scales kF16[] = {{"Q4_0", {0}, 1}, {"Q4_1", {0, 2}, 2}, {"Q5_0", {0}, 1}, {"Q5_1", {0, 2}, 2},
                       {"Q8_0", {0}, 1}, {"Q2_K", {80, 82}, 2}, {"Q3_K", {108}, 1}, {"Q4_K", {0, 2}, 2},
                       {"Q5_K", {0, 2}, 2}, {"Q6_K", {208}, 1}, {"IQ4_NL", {0}, 1}, {"IQ4_XS", {0}, 1}};
const char* kTypes[] = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                        "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"};

uint16_t to_f16(float v) {  // moderate normal values only (the tests' scales)
    uint32_t b;
    std::memcpy(&b, &v, 4);
    const uint32_t sign = (b >> 16) & 0x8000, exp = ((b >> 23) & 255) - 112, mant = (b >> 13) & 1023;
    return uint16_t(sign | (exp << 10) | mant);
}

std::vector<uint8_t> random_blocks(const Format& f, int64_t n, int64_t k, std::mt19937& g) {
    std::vector<uint8_t> w(row_bytes(f, k) * size_t(n));
    std::uniform_real_distribution<float> scale(0.002f, 0.02f), normal(-2.0f, 2.0f);
    if (f.is_float) {
        for (int64_t i = 0; i < n * k; ++i) {
            const float v = normal(g);
            if (f.type == BlockType::F32) std::memcpy(&w[size_t(i) * 4], &v, 4);
            else {
                uint16_t h;
                if (f.type == BlockType::F16) h = to_f16(v);
                else { uint32_t b; std::memcpy(&b, &v, 4); h = uint16_t(b >> 16); }
                std::memcpy(&w[size_t(i) * 2], &h, 2);
            }
        }
        return w;
    }
    for (auto& b : w) b = uint8_t(g());
    const size_t blocks = w.size() / size_t(f.bytes);
    for (size_t i = 0; i < blocks; ++i) {
        uint8_t* blk = &w[i * size_t(f.bytes)];
        if (f.type == BlockType::MXFP4) blk[0] = uint8_t(118 + g() % 12);
        for (const Scales& s : kF16)
            if (std::strcmp(s.type, f.name) == 0)
                for (int j = 0; j < s.count; ++j) {
                    const uint16_t h = to_f16(scale(g));
                    std::memcpy(blk + s.offsets[j], &h, 2);
                }
    }
    return w;
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        den += double(b[i]) * b[i];
    }
    return std::sqrt(num / std::max(den, 1e-300));
}

bool bitwise(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// `gathered`: the rows read through Product::rows from a copy of w in reverse order (the sparse FFN's up).
std::vector<float> run(RowsKernel kernel, QuantizeRows quantize, const Format& f, const std::vector<uint8_t>& w,
                       int64_t n, int64_t k, const std::vector<float>& x, int64_t m, bool exact, bool gathered = false) {
    Activations a;
    prepare(a, x.data(), m, k, !exact && !f.is_float, f.block == 256 ? 256 : 32);
    if (!exact && !f.is_float) quantize(a, 0, m);
    std::vector<float> y(size_t(m * n));
    Product p;
    p.fmt = &f; p.w = w.data(); p.row_bytes = row_bytes(f, k); p.K = k; p.N = n; p.M = m;
    p.a = &a; p.y = y.data(); p.ldy = n; p.exact = exact;
    std::vector<uint8_t> reversed(w.size());
    std::vector<const uint8_t*> rows(static_cast<size_t>(n));
    if (gathered) {
        for (int64_t r = 0; r < n; ++r) {
            std::memcpy(&reversed[size_t(n - 1 - r) * p.row_bytes], &w[size_t(r) * p.row_bytes], p.row_bytes);
            rows[size_t(r)] = &reversed[size_t(n - 1 - r) * p.row_bytes];
        }
        p.w = nullptr;
        p.rows = rows.data();
    }
    kernel(p, 0, n / 2);  // two column ranges, as two threads take them
    kernel(p, n / 2, n);
    return y;
}

}  // namespace

// Each instruction set's activation quantization against the scalar one: the same bits, every field.
int quantization_failures(const KernelTable& t, std::mt19937& g) {
    int failures = 0;
    std::normal_distribution<float> nd;
    for (int group : {32, 256}) {
        const int64_t rows = 3, cols = 3 * 256;
        std::vector<float> x(size_t(rows * cols));
        for (auto& v : x) v = nd(g) * 3.0f;
        for (int64_t j = 0; j < cols / 2; ++j) x[size_t(cols + j)] = 0.0f;  // zero groups
        x[5] = 1e30f;                                                        // one huge value
        Activations want, got;
        prepare(want, x.data(), rows, cols, true, group);
        prepare(got, x.data(), rows, cols, true, group);
        scalar_kernels().quantize(want, 0, rows);
        t.quantize(got, 0, rows);
        if (want.q != got.q || want.d != got.d || want.dsum != got.dsum || want.lanes != got.lanes ||
            want.gsum != got.gsum ||
            want.bsums != got.bsums) {
            std::printf("FAIL %s quantization (group %d) differs from the scalar one\n", t.isa, group);
            ++failures;
        }
    }
    return failures;
}

// round_to_f16 (the activations' f16 scale) against the compiler's own IEEE conversion to _Float16, over one
// f32 bit pattern in 4099 (both signs, every exponent: zeros, f16 subnormals, ties, overflow, infinities, NaN).
int f16_rounding_failures() {
    int failures = 0;
    for (uint64_t b = 0; b <= 0xffffffffull; b += 4099) {
        const uint32_t bits = uint32_t(b);
        float f;
        std::memcpy(&f, &bits, 4);
        const float want = float(_Float16(f)), got = round_to_f16(f);
        if (std::isnan(want) ? !std::isnan(got) : std::memcmp(&want, &got, 4) != 0) {
            if (++failures <= 5) std::printf("FAIL round_to_f16(%a) = %a, IEEE %a\n", double(f), double(got), double(want));
        }
    }
    return failures;
}

// The SIMD tables of the sets this CPU runs (a table is built only then: building it runs that set's code).
std::vector<const KernelTable*> runnable_tables() {
    const std::pair<const char*, const KernelTable& (*)()> sets[] = {
        {"avx2", avx2_kernels}, {"avxvnni", avxvnni_kernels}, {"avx512vnni", avx512vnni_kernels}};
    std::vector<const KernelTable*> out;
    for (const auto& [name, table] : sets)
        if (cpu_has(name)) out.push_back(&table());
    return out;
}

// Activation rows a batch: 7 (the prefill tiles from 4 rows, and the rest), and for one K past the column tiles'
// threshold (x86/prefill.h kColumnsRows), an odd count.
constexpr int64_t kFewRows = 7, kManyRows = 35;

int main() {
    std::mt19937 g(12345);
    int failures = f16_rounding_failures(), checks = 1;
    const std::vector<const KernelTable*> isas = runnable_tables();
    for (const KernelTable* t : isas) { failures += quantization_failures(*t, g); ++checks; }
    for (const char* name : kTypes) {
        const Format& f = *format_by_name(name);
        const int64_t per = f.block == 1 ? 32 : f.block;
        for (int64_t n : {1, 6, 17}) {  // tiles of 4 and 16 weight rows, and their edges
            for (int64_t kb : {1, 3, 19}) {  // 19 groups of 32: two full spans of 8 and a partial one
                const int64_t k = kb * per + (f.block == 1 ? 5 : 0);
                const int64_t kRows = kb == 3 ? kManyRows : kFewRows;
                const auto w = random_blocks(f, n, k, g);
                std::normal_distribution<float> nd;
                std::vector<float> x(size_t(kRows * k));
                for (auto& v : x) v = nd(g);
                for (bool exact : {false, true}) {
                    const int id = int(f.type);
                    const auto want = run(exact ? scalar_kernels().exact[id] : scalar_kernels().quantized[id],
                                          scalar_kernels().quantize, f, w, n, k, x, kRows, exact);
                    const RowsKernel scalar = exact ? scalar_kernels().exact[id] : scalar_kernels().quantized[id];
                    if (!bitwise(run(scalar, scalar_kernels().quantize, f, w, n, k, x, kRows, exact, true), want)) {
                        std::printf("FAIL scalar %s gathered rows differ from the matrix's\n", name);
                        ++failures;
                    }
                    for (const KernelTable* t : isas) {
                        RowsKernel kernel = exact ? t->exact[id] : t->quantized[id];
                        const auto got = run(kernel, t->quantize, f, w, n, k, x, kRows, exact);
                        ++checks;
                        if (!(rel(got, want) <= 1e-5)) {
                            std::printf("FAIL %s %s n=%ld k=%ld exact=%d rel=%g\n", t->isa, name, long(n), long(k),
                                        int(exact), rel(got, want));
                            ++failures;
                        }
                        if (!bitwise(run(kernel, t->quantize, f, w, n, k, x, kRows, exact, true), got)) {
                            std::printf("FAIL %s %s gathered rows differ from the matrix's\n", t->isa, name);
                            ++failures;
                        }
                        for (int64_t m : {int64_t(0), int64_t(3), int64_t(6), kRows - 1}) {  // alone: bitwise the batch
                            std::vector<float> one(x.begin() + m * k, x.begin() + (m + 1) * k);
                            const auto alone = run(kernel, t->quantize, f, w, n, k, one, 1, exact);
                            if (std::memcmp(alone.data(), got.data() + m * n, size_t(n) * 4) != 0) {
                                std::printf("FAIL %s %s row %ld alone differs from the batch\n", t->isa, name, long(m));
                                ++failures;
                            }
                        }
                    }
                }
            }
        }
    }
    failures += sparse_failures(isas, g, checks);
    std::printf("%d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
