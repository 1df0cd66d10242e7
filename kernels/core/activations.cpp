#include "activations.h"

#include <cmath>

namespace fleet {

void prepare(Activations& a, const float* x, int64_t rows, int64_t cols, bool quantized, int group) {
    a.rows = rows;
    a.cols = cols;
    a.x = x;
    a.group = group;
    if (!quantized) return;
    a.q.resize(size_t(rows * cols));
    a.d.resize(size_t(rows * (cols / group)));
    if (group == 256) {
        a.bsums.resize(size_t(rows * (cols / 16)));
        return;
    }
    a.dsum.resize(size_t(rows * (cols / 16)));
    a.lanes.resize(size_t(rows * (cols / 32) * 8));
    a.gsum.resize(size_t(rows * (cols / 32) * 2));
}

namespace {

// q = rint(x * (127 / max|x|)) clamped to [-127, 127] for `n` values; returns d = max|x| / 127.
float quantize_group(const float* x, int n, int8_t* q) {
    float amax = 0.0f;
    for (int j = 0; j < n; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < n; ++j) {
        const float v = std::nearbyint(x[j] * id);
        q[j] = int8_t(std::fmin(127.0f, std::fmax(-127.0f, v)));
    }
    return amax / 127.0f;
}

void quantize_row32(Activations& a, int64_t m) {
    const int64_t groups = a.cols / 32;
    const float* x = a.x_row(m);
    int8_t* q = a.q.data() + m * a.cols;
    float* d = a.d.data() + m * groups;
    float* dsum0 = a.dsum.data() + 2 * m * groups;
    float* dsum1 = dsum0 + groups;
    int32_t* lanes = a.lanes.data() + m * groups * 8;
    int32_t* gsum = a.gsum.data() + m * groups * 2;
    for (int64_t g = 0; g < groups; ++g) {
        int8_t* qg = q + g * 32;
        d[g] = group32_scale(quantize_group(x + g * 32, 32, qg));
        int sums[2] = {0, 0};
        for (int j = 0; j < 32; ++j) sums[j / 16] += qg[j];
        for (int l = 0; l < 8; ++l) lanes[g * 8 + l] = -(int32_t(qg[4 * l]) + qg[4 * l + 1] + qg[4 * l + 2] + qg[4 * l + 3]);
        gsum[2 * g] = -sums[0];
        gsum[2 * g + 1] = -sums[1];
        dsum0[g] = d[g] * float(sums[0]);
        dsum1[g] = d[g] * float(sums[1]);
    }
}

void quantize_row256(Activations& a, int64_t m) {
    const int64_t blocks = a.cols / 256;
    const float* x = a.x_row(m);
    int8_t* q = a.q.data() + m * a.cols;
    float* d = a.d.data() + m * blocks;
    int16_t* bsums = a.bsums.data() + m * (a.cols / 16);
    for (int64_t b = 0; b < blocks; ++b) {
        int8_t* qb = q + b * 256;
        d[b] = quantize_group(x + b * 256, 256, qb);
        for (int g = 0; g < 16; ++g) {
            int sum = 0;
            for (int j = 0; j < 16; ++j) sum += qb[16 * g + j];
            bsums[b * 16 + bsum_slot(g)] = int16_t(sum);
        }
    }
}

}  // namespace

void quantize_rows(Activations& a, int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) {
        if (a.group == 256)
            quantize_row256(a, m);
        else
            quantize_row32(a, m);
    }
}

}  // namespace fleet
