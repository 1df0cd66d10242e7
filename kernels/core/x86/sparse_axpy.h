// The axpy y [M, D] = h x down_t over the kept neurons (core/sparse.h) as a tiled GEMM. Included by x86/sparse.h.
// Every y[m, j] sees its fmas in ascending neuron order whatever the layout below, so the same bits as the scalar
// oracle, for one row alone or in any batch.
//
// One row (decode, and a batch's odd row): the kept neurons kGroup at a time, each group's rows streamed side by side
// over the thread's columns (a block of 32 columns a step: its t = h s per neuron, then per 8 columns y loaded from
// L1, kGroup fmas, stored), with the rows kAheadRows further on prefetched at the same columns (into L2, as the
// products do: driver.h), so that the scattered rows of the kept neurons stream from memory while these are added.
// Measured here (one core, Q8_0 2048 x 8192, every neuron): 3.5 GB/s with the partial sums in registers over 4 neurons
// a 64-column step (spilled, and each neuron's setup repeated every 64 columns); this way 11-12 GB/s in L2 and
// 8-12 from memory, within 1.1-1.2x of the Q8_0 product of the same bytes (its integer dot takes 32 weights an
// instruction, the axpy converts and multiplies 8: a bare loop of vpmovsxbd + vcvtdq2ps + vfmadd reaches 14-16
// GB/s on this machine). 8 neurons a group measured 1.13x the product, 4 1.21x, 2 1.25x.
//
// Several rows (a batch group, a prefill chunk): a thread's columns kAxpyColumns at a time, the union of kept
// neurons kAxpyChunk at a time (ascending), the rows in tiles of 2 or 4 whose partial sums stay in registers while the
// chunk's neurons pass: each neuron's codes are converted to floats once for all the tile's rows. Between chunks the
// partial sums wait in y (L1 or L2); the chunk's bytes stay in L2 while every row tile meets them.

constexpr int64_t kAxpyColumns = 1024;  // columns a pass of the tiles: a 4-row tile's partial sums, 16 KB, stay in L1
constexpr int kAxpyChunk = 32;          // neurons a pass of the tiles: their bytes at those columns, 34 KB of Q8_0
constexpr int64_t kRowColumns = 4096;   // columns a pass of one row: its partial sums, 16 KB, stay in L1
constexpr int kGroup = 8;               // neurons a row adds side by side
constexpr int kAheadRows = 16;          // prefetch distance of the row path, in neurons
constexpr int kAxpyWideNV = FLEET_WIDE_REGISTERS ? 4 : 2;  // registers of 8 columns a row in the 4-row tile

// Where the tile of the first rows prefetches: the next chunk's neurons (ids), at the tile's columns + shift (the
// next column block's, after the last chunk), below `limit` (the end of the thread's columns).
struct AxpyPrefetch {
    const int32_t* neurons = nullptr;
    int n = 0;
    int64_t shift = 0, limit = 0;
};

// Prefetch-only functions are always inlined: GCC drops calls to one (it counts as free of side effects).
template <class A>
__attribute__((always_inline)) static inline void prefetch_span(const uint8_t* row, int64_t j, int64_t width) {
    const uintptr_t lo = uintptr_t(row + A::first_byte(j)) & ~uintptr_t(63), hi = uintptr_t(row + A::last_byte(j + width - 1));
    for (uintptr_t at = lo; at <= hi; at += 64) _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
}

template <class A>
__attribute__((always_inline)) static inline void prefetch_columns(const SparseAxpy& p, int32_t neuron,
                                                                   const AxpyPrefetch& pf, int64_t j, int64_t width) {
    j += pf.shift;
    if (j >= pf.limit) return;
    prefetch_span<A>(p.w + size_t(neuron) * p.row_bytes, j, std::min(width, pf.limit - j));
}

// Columns j .. j + 7 of a row (j a multiple of 8; for a float type any column).
template <class A>
static inline __m256 code8(const uint8_t* row, int64_t j) {
    if constexpr (A::FLOAT) return A::codes8(row + A::first_byte(j), 0);
    return A::codes8(row + A::first_byte(j), int(j % 32 / 8));
}

// The union positions a row adds: list[e] (a tile's list), or e itself (a row alone: every neuron of the union).
struct Positions {
    const int32_t* list;
    inline int64_t operator[](int64_t e) const { return list != nullptr ? list[e] : e; }
};

// Row m, columns [c0, c1): G neurons, positions e .. e + G - 1 of `pos` (of n), added side by side to y in order;
// `first`: y starts at +0 rather than its partial sums. The rows kAheadRows on are prefetched at the same columns.
template <class A, int G>
static inline void axpy_group(const SparseAxpy& p, int64_t m, int64_t c0, int64_t c1, Positions pos, int64_t e,
                              int64_t n, bool first) {
    const uint8_t* rows[G];
    float h[G];
    FLEET_UNROLL
    for (int g = 0; g < G; ++g) {
        const int64_t k = pos[e + g];
        rows[g] = p.w + size_t(p.neurons[k]) * p.row_bytes;
        h[g] = p.h[m * p.count + k];
    }
    const int64_t at = A::first_byte(c0);  // c0: a block's first column (integer types), a float type's any
    const int ahead = int(std::max<int64_t>(0, std::min<int64_t>(G, n - e - kAheadRows)));
    const uint8_t* next[G] = {};
    for (int g = 0; g < ahead; ++g) next[g] = p.w + size_t(p.neurons[pos[e + kAheadRows + g]]) * p.row_bytes + at;
    float* y = p.y + m * p.ldy;
    const uint8_t* blk[G];
    FLEET_UNROLL
    for (int g = 0; g < G; ++g) blk[g] = rows[g] + at;
    int64_t j = c0;
    for (; j + 32 <= c1; j += 32) {  // a block of 32 columns (the integer types' block: one t a neuron)
        for (int g = 0; g < ahead; ++g) {  // each line of the block's bytes: the last byte's of each 64
            FLEET_UNROLL
            for (int64_t off = A::BYTES - 1; off >= 0; off -= 64) _mm_prefetch(reinterpret_cast<const char*>(next[g] + off), _MM_HINT_T1);
            next[g] += A::BYTES;
        }
        __m256 t[G];
        FLEET_UNROLL
        for (int g = 0; g < G; ++g) t[g] = _mm256_set1_ps(A::FLOAT ? h[g] : h[g] * A::scale(blk[g]));
        FLEET_UNROLL
        for (int q = 0; q < 4; ++q) {
            __m256 acc = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + j + 8 * q);
            FLEET_UNROLL
            for (int g = 0; g < G; ++g) acc = _mm256_fmadd_ps(t[g], A::codes8(blk[g], q), acc);
            _mm256_storeu_ps(y + j + 8 * q, acc);
        }
        FLEET_UNROLL
        for (int g = 0; g < G; ++g) blk[g] += A::BYTES;
    }
    if constexpr (A::FLOAT) {  // a float type's last columns: 8 at a time, then one at a time
        for (; j + 8 <= c1; j += 8) {
            __m256 acc = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + j);
            FLEET_UNROLL
            for (int g = 0; g < G; ++g) acc = _mm256_fmadd_ps(_mm256_set1_ps(h[g]), A::codes8(rows[g] + A::first_byte(j), 0), acc);
            _mm256_storeu_ps(y + j, acc);
        }
        for (; j < c1; ++j) {
            float acc = first ? 0.0f : y[j];
            for (int g = 0; g < G; ++g) acc = std::fma(h[g], A::weight(rows[g], j), acc);
            y[j] = acc;
        }
    }
}

// Row m, columns [c0, c1): the n neurons of `pos` in order, kGroup at a time.
template <class A>
static void axpy_row(const SparseAxpy& p, int64_t m, int64_t c0, int64_t c1, Positions pos, int64_t n, bool first) {
    if (n == 0 && first) std::fill(p.y + m * p.ldy + c0, p.y + m * p.ldy + c1, 0.0f);
    int64_t e = 0;
    for (; e + kGroup <= n; e += kGroup) axpy_group<A, kGroup>(p, m, c0, c1, pos, e, n, first && e == 0);
    for (; e < n; ++e) axpy_group<A, 1>(p, m, c0, c1, pos, e, n, first && e == 0);
}

// MB rows (2 or 4) from m x NV registers of 8 columns from j, over the union positions list[0..n) (ascending). A row
// adds a neuron only where it keeps it. Integer types: t = h s, or an exact +0 where
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
        for (int q = 0; q < NV; ++q) c[q] = code8<A>(row, j + 8 * q);
        float s[kScales];
        FLEET_UNROLL
        for (int b = 0; b < kScales; ++b) s[b] = A::FLOAT ? 1.0f : A::scale(row + A::first_byte(j + 32 * b));
        FLEET_UNROLL
        for (int r = 0; r < MB; ++r) {
            const float h = p.h[(m + r) * p.count + k];
            const bool kept = p.keep == nullptr || p.keep[(m + r) * p.count + k];
            if constexpr (A::FLOAT) {
                const __m256 hv = _mm256_set1_ps(h);
                const __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(kept ? -1 : 0));
                FLEET_UNROLL
                for (int q = 0; q < NV; ++q)
                    acc[r][q] = _mm256_blendv_ps(acc[r][q], _mm256_fmadd_ps(hv, c[q], acc[r][q]), keep);
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

// The chunk's prefetch target for the tiles: kAheadChunks chunks on at these columns, or past the union's end the
// next column block's first neurons.
constexpr int kAheadChunks = 1;
static inline AxpyPrefetch chunk_ahead(const SparseAxpy& p, int64_t k0, int64_t c0, int64_t c1, int64_t j1) {
    AxpyPrefetch pf;
    const int64_t ahead = k0 + kAheadChunks * kAxpyChunk;
    const bool wrap = ahead >= p.count;
    const int64_t at = wrap ? std::min<int64_t>(ahead - p.count, p.count) / kAxpyChunk * kAxpyChunk : ahead;
    pf.neurons = p.neurons + at;
    pf.n = int(std::min<int64_t>(kAxpyChunk, p.count - at));
    pf.shift = wrap ? c1 - c0 : 0;
    pf.limit = j1;
    return pf;
}

template <class A>
static void axpy_rows(const SparseAxpy& p, int64_t j0, int64_t j1) {
    if (p.M == 1 && p.keep == nullptr) {  // one row: every neuron of the union, in order
        for (int64_t c0 = j0; c0 < j1; c0 += kRowColumns)
            axpy_row<A>(p, 0, c0, std::min(j1, c0 + kRowColumns), Positions{nullptr}, p.count, true);
        return;
    }
    int32_t list[kAxpyChunk];
    for (int64_t c0 = j0; c0 < j1; c0 += kAxpyColumns) {
        const int64_t c1 = std::min(j1, c0 + kAxpyColumns);
        for (int64_t k0 = 0; k0 == 0 || k0 < p.count; k0 += kAxpyChunk) {  // once with no neuron: y = 0
            const int64_t k1 = std::min(p.count, k0 + kAxpyChunk);
            const AxpyPrefetch pf = chunk_ahead(p, k0, c0, c1, j1);
            for (int64_t m = 0; m < p.M;) {
                const int mb = p.M - m >= 4 ? 4 : p.M - m >= 2 ? 2 : 1;
                const int n = tile_list(p, m, mb, k0, k1, list);
                const AxpyPrefetch& ahead = m == 0 ? pf : AxpyPrefetch{};
                if (mb == 4)
                    axpy_columns<A, 4, kAxpyWideNV>(p, m, c0, c1, list, n, k0 == 0, ahead);
                else if (mb == 2)
                    axpy_columns<A, 2, 4>(p, m, c0, c1, list, n, k0 == 0, ahead);
                else
                    axpy_row<A>(p, m, c0, c1, Positions{list}, n, k0 == 0);
                m += mb;
            }
        }
    }
}
