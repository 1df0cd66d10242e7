#include "activations.h"

#include <cmath>

namespace fleet {

void prepare(Activations& a, const float* x, int64_t rows, int64_t cols, bool quantized) {
    a.rows = rows;
    a.cols = cols;
    a.x = x;
    if (!quantized) return;
    a.q.resize(size_t(rows * cols));
    a.d.resize(size_t(rows * (cols / 32)));
    a.dsum.resize(size_t(rows * (cols / 16)));
    a.lanes.resize(size_t(rows * (cols / 32) * 8));
}

void quantize_rows(Activations& a, int64_t r0, int64_t r1) {
    const int64_t groups = a.cols / 32;
    for (int64_t m = r0; m < r1; ++m) {
        const float* x = a.x_row(m);
        int8_t* q = a.q.data() + m * a.cols;
        float* d = a.d.data() + m * groups;
        float* dsum0 = a.dsum.data() + 2 * m * groups;
        float* dsum1 = dsum0 + groups;
        int32_t* lanes = a.lanes.data() + m * groups * 8;
        for (int64_t g = 0; g < groups; ++g) {
            const float* xg = x + g * 32;
            float amax = 0.0f;
            for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(xg[j]));
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int sums[2] = {0, 0};
            for (int j = 0; j < 32; ++j) {
                float v = std::nearbyint(xg[j] * id);
                v = std::fmin(127.0f, std::fmax(-127.0f, v));
                q[g * 32 + j] = int8_t(v);
                sums[j / 16] += int(v);
            }
            for (int l = 0; l < 8; ++l) {
                const int8_t* ql = q + g * 32 + 4 * l;
                lanes[g * 8 + l] = -(int32_t(ql[0]) + ql[1] + ql[2] + ql[3]);
            }
            d[g] = amax / 127.0f;
            dsum0[g] = d[g] * float(sums[0]);
            dsum1[g] = d[g] * float(sums[1]);
        }
    }
}

}  // namespace fleet
