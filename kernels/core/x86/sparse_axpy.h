// The axpy y [M, D] += h x down_t over the kept neurons (core/sparse.h) as a tiled GEMM: a thread's columns are
// taken kAxpyColumns at a time, the union of kept neurons kAxpyChunk at a time (ascending), and the rows in tiles of
// 1, 2 or 4 whose partial sums stay in registers while the chunk's neurons pass: each neuron's codes are converted
// to floats once for all the tile's rows. Between chunks the partial sums wait in y (L1 or L2), so every y[m, j]
// sees its fmas in ascending neuron order whatever the tiles, the chunks or the thread's columns: the same bits as
// the scalar oracle, for one row alone or in any batch. Included by x86/sparse.h.
//
// Decode (one row) is a sum of whole rows of down_t, read once: each chunk's tile issues prefetches (into L2, as
// the products do: driver.h) of the next chunk's bytes at the same columns, so that the scattered rows of the kept
// neurons stream from memory while the current ones are added.

constexpr int64_t kAxpyColumns = 1024;  // columns a pass: a 4-row tile's partial sums, 16 KB, stay in L1
constexpr int kAxpyChunk = 32;          // neurons a pass: their bytes at those columns (34 KB of Q8_0) stay in L2
                                        // while every row tile meets them
constexpr int kAxpyWideNV = FLEET_WIDE_REGISTERS ? 4 : 2;  // registers of 8 columns a row in the 4-row tile

// Where the tile of the first rows prefetches: the next chunk's neurons (ids), at the tile's columns + shift (the
// next column block's, after the last chunk), below `limit` (the end of the thread's columns).
struct AxpyPrefetch {
    const int32_t* neurons = nullptr;
    int n = 0;
    int64_t shift = 0, limit = 0;
};

template <class A>
static inline void prefetch_columns(const SparseAxpy& p, int32_t neuron, const AxpyPrefetch& pf, int64_t j, int64_t width) {
    j += pf.shift;
    if (j >= pf.limit) return;
    width = std::min(width, pf.limit - j);
    const char* row = reinterpret_cast<const char*>(p.w + size_t(neuron) * p.row_bytes);
    const uintptr_t lo = uintptr_t(row + A::first_byte(j)) & ~uintptr_t(63), hi = uintptr_t(row + A::last_byte(j + width - 1));
    for (uintptr_t at = lo; at <= hi; at += 64) _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
}

// MB rows from m x NV registers of 8 columns from j, over the union positions list[0..n) (ascending). A row adds a
// neuron only where it keeps it (MB = 1: the list holds only its own). Integer types: t = h s, or an exact +0 where
// the row does not keep the neuron (fma(+0, c, y) = y for a finite code c, and y, summed from +0, is never -0);
// float types, whose weight may be infinite, keep y by a blend instead.
template <class A, int MB, int NV>
static inline void axpy_tile(const SparseAxpy& p, int64_t m, int64_t j, const int32_t* list, int n, bool first,
                             const AxpyPrefetch& pf) {
    constexpr int kScales = NV >= 4 ? NV / 4 : 1;  // blocks of 32 under the tile's columns (they start a block if NV >= 4)
    __m256 acc[MB][NV];
    FLEET_UNROLL
    for (int r = 0; r < MB; ++r)
        FLEET_UNROLL
        for (int q = 0; q < NV; ++q) acc[r][q] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(p.y + (m + r) * p.ldy + j + 8 * q);
    for (int e = 0; e < n; ++e) {
        const int64_t k = list[e];
        const uint8_t* row = p.w + size_t(p.neurons[k]) * p.row_bytes;
        if (e < pf.n) prefetch_columns<A>(p, pf.neurons[e], pf, j, 8 * NV);
        __m256 c[NV];
        FLEET_UNROLL
        for (int q = 0; q < NV; ++q) c[q] = A::codes8(row, j + 8 * q);
        float s[kScales];
        FLEET_UNROLL
        for (int b = 0; b < kScales; ++b) s[b] = A::FLOAT ? 1.0f : A::scale(row, j + 32 * b);
        FLEET_UNROLL
        for (int r = 0; r < MB; ++r) {
            const float h = p.h[(m + r) * p.count + k];
            const bool kept = MB == 1 || p.keep == nullptr || p.keep[(m + r) * p.count + k];
            if constexpr (A::FLOAT) {
                const __m256 hv = _mm256_set1_ps(h);
                const __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(kept ? -1 : 0));
                FLEET_UNROLL
                for (int q = 0; q < NV; ++q)
                    acc[r][q] = MB == 1 ? _mm256_fmadd_ps(hv, c[q], acc[r][q])
                                        : _mm256_blendv_ps(acc[r][q], _mm256_fmadd_ps(hv, c[q], acc[r][q]), keep);
            } else {
                __m256 t[kScales];
                FLEET_UNROLL
                for (int b = 0; b < kScales; ++b) t[b] = _mm256_set1_ps(kept ? h * s[b] : 0.0f);
                FLEET_UNROLL
                for (int q = 0; q < NV; ++q) acc[r][q] = _mm256_fmadd_ps(t[q * kScales / NV], c[q], acc[r][q]);
            }
        }
    }
    for (int e = n; e < pf.n; ++e) prefetch_columns<A>(p, pf.neurons[e], pf, j, 8 * NV);
    FLEET_UNROLL
    for (int r = 0; r < MB; ++r)
        FLEET_UNROLL
        for (int q = 0; q < NV; ++q) _mm256_storeu_ps(p.y + (m + r) * p.ldy + j + 8 * q, acc[r][q]);
}

// The last D % 8 columns of a float type, one at a time: the same fmas in the same order.
template <class A>
static void axpy_tail(const SparseAxpy& p, int64_t m, int mb, int64_t j, int64_t j1, const int32_t* list, int n, bool first) {
    for (int r = 0; r < mb; ++r)
        for (int64_t c = j; c < j1; ++c) {
            float* y = p.y + (m + r) * p.ldy + c;
            float acc = first ? 0.0f : *y;
            for (int e = 0; e < n; ++e) {
                const int64_t k = list[e];
                if (p.keep != nullptr && !p.keep[(m + r) * p.count + k]) continue;
                acc = std::fma(p.h[(m + r) * p.count + k], A::weight(p.w + size_t(p.neurons[k]) * p.row_bytes, c), acc);
            }
            *y = acc;
        }
}

// One row tile (MB rows) over columns [c0, c1): the widest tiles first, then 8 columns, then the float types' tail.
template <class A, int MB, int NV>
static void axpy_columns(const SparseAxpy& p, int64_t m, int64_t c0, int64_t c1, const int32_t* list, int n, bool first,
                         const AxpyPrefetch& pf) {
    int64_t j = c0;
    for (; j + 8 * NV <= c1; j += 8 * NV) axpy_tile<A, MB, NV>(p, m, j, list, n, first, pf);
    if constexpr (NV > 4)
        for (; j + 32 <= c1; j += 32) axpy_tile<A, MB, 4>(p, m, j, list, n, first, pf);
    for (; j + 8 <= c1; j += 8) axpy_tile<A, MB, 1>(p, m, j, list, n, first, pf);
    if constexpr (A::FLOAT)
        if (j < c1) axpy_tail<A>(p, m, MB, j, c1, list, n, first);
}

// The union positions in [k0, k1) that any of rows m .. m + mb - 1 keeps, ascending; returns their number.
static inline int tile_list(const SparseAxpy& p, int64_t m, int mb, int64_t k0, int64_t k1, int32_t* list) {
    int n = 0;
    for (int64_t k = k0; k < k1; ++k) {
        bool any = p.keep == nullptr;
        for (int r = 0; r < mb; ++r) any |= p.keep != nullptr && p.keep[(m + r) * p.count + k] != 0;
        list[n] = int32_t(k);
        n += any;
    }
    return n;
}

template <class A>
static void axpy_rows(const SparseAxpy& p, int64_t j0, int64_t j1) {
    int32_t list[kAxpyChunk];
    for (int64_t c0 = j0; c0 < j1; c0 += kAxpyColumns) {
        const int64_t c1 = std::min(j1, c0 + kAxpyColumns);
        for (int64_t k0 = 0; k0 == 0 || k0 < p.count; k0 += kAxpyChunk) {  // once with no neuron: y = 0
            const int64_t k1 = std::min(p.count, k0 + kAxpyChunk);
            AxpyPrefetch pf;  // the next chunk at these columns, or after the last one the next columns' first
            const bool last = k1 == p.count;
            pf.neurons = p.neurons + (last ? 0 : k1);
            pf.n = int(std::min<int64_t>(kAxpyChunk, last ? p.count : p.count - k1));
            pf.shift = last ? c1 - c0 : 0;
            pf.limit = j1;
            for (int64_t m = 0; m < p.M;) {
                const int mb = p.M - m >= 4 ? 4 : p.M - m >= 2 ? 2 : 1;
                const int n = tile_list(p, m, mb, k0, k1, list);
                const AxpyPrefetch& ahead = m == 0 ? pf : AxpyPrefetch{};
                if (mb == 4)
                    axpy_columns<A, 4, kAxpyWideNV>(p, m, c0, c1, list, n, k0 == 0, ahead);
                else if (mb == 2)
                    axpy_columns<A, 2, 4>(p, m, c0, c1, list, n, k0 == 0, ahead);
                else
                    axpy_columns<A, 1, 8>(p, m, c0, c1, list, n, k0 == 0, ahead);
                m += mb;
            }
        }
    }
}
