// The prefill tiles of one x86 instruction set (many activation rows: a verify, a batch group, a prefill
// chunk). Included by driver.h after the decode tiles, whose integer and float operations these repeat in
// the same order (tile_quantized, block_sums, block_end).

// ---- many activation rows (a verify, a batch group, a prefill chunk): a tile of 4 weight rows is unpacked once
// into 32-byte codes and per-group scales, then every activation row meets it. The integers of each dot and
// the float operations on them are those of tile_quantized, in the same order: bitwise the same results.
// Signed codes are kept as c + 128 (kOffsetCodes: VNNI only, so AVX2 keeps tile_quantized for those types).
constexpr int kPrefillRows = 4;  // at and above this many activation rows
#if FLEET_VNNI
constexpr int kPrefillMB = FLEET_WIDE_REGISTERS ? 4 : 2;  // activation rows a pass: 16 accumulators need 32 registers
#else
constexpr int kPrefillMB = 2;
#endif

// An unpacked tile by plain pointers: the kernels must not touch the thread_local holding it (each access
// to a thread_local of a shared library is a call, which spilled every accumulator).
struct TileView {
    int64_t groups;
    const uint8_t* codes;
    const float *s0, *o0;
};

template <class F>
struct UnpackedTile {
    static_assert(F::QK == 32 && !F::PER16 && (FLEET_VNNI || !F::SIGNED), "see tile_quantized, kOffsetCodes");
    int64_t groups = 0;
    std::vector<uint8_t> codes;  // [4][groups][32]
    std::vector<float> s0, o0;  // [4][groups]: a sub-block's scale and offset

    void unpack(const Product& p, int64_t n, int rows) {
        groups = p.K / 32;
        codes.assign(size_t(4 * groups * 32), 0);
        s0.assign(size_t(4 * groups), 0.0f); o0 = s0;
        for (int r = 0; r < rows; ++r) {
            const uint8_t* row = p.w + (n + r) * p.row_bytes;
            for (int64_t g0 = 0; g0 < groups; g0 += 8) {
                const int span = int(std::min<int64_t>(8, groups - g0));
                Span<F> sp;
                sp.read_quantized(span_block<F>(row, g0), span);
                for (int j = 0; j < span; ++j) {
                    const size_t at = size_t(r * groups + g0 + j);
                    s0[at] = sp.s0[j]; o0[at] = sp.o0[j];
                    int sub;
                    const uint8_t* blk = sub_block<F>(row, g0, j, sub);
                    __m256i c = F::codes(blk, sub);
                    if constexpr (kOffsetCodes<F>) c = _mm256_xor_si256(c, mask8(0x80));
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&codes[at * 32]), c);
                }
            }
        }
    }
    TileView view() const { return TileView{groups, codes.data(), s0.data(), o0.data()}; }
};

template <class F, int MB>
static inline void tile_prefill(const Product& p, const TileView& t, int64_t n, int rows, int64_t m) {
    constexpr int R = 4;
    const int64_t groups = t.groups;
    const QuantizedRows<MB> act(*p.a, m);
    const int8_t* const* q = act.q;
    const float *const *da = act.d, *const *ds0 = act.ds0, *const *ds1 = act.ds1;
    const int32_t* const* lanes = act.lanes;
    __m256 acc[R][MB];
    alignas(32) float corr[R][MB][8];
    FLEET_UNROLL
    for (int r = 0; r < R; ++r)
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) { acc[r][i] = _mm256_setzero_ps(); _mm256_store_ps(corr[r][i], _mm256_setzero_ps()); }
    for (int64_t g0 = 0; g0 < groups; g0 += 8) {
        const int span = int(std::min<int64_t>(8, groups - g0));
        alignas(32) float sd0[R][MB][8];
        FLEET_UNROLL
        for (int r = 0; r < R; ++r) {
            const size_t at = size_t(r * groups + g0);
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) {
                const __m256 d = load8(da[i] + g0, span);
                _mm256_store_ps(sd0[r][i], _mm256_mul_ps(load8(&t.s0[at], span), d));
                if constexpr (F::OFFSET) {
                    const __m256 o = load8(&t.o0[at], span);
                    __m256 c = _mm256_load_ps(corr[r][i]);
                    c = _mm256_fmadd_ps(o, load8(ds0[i] + g0, span), c);
                    c = _mm256_fmadd_ps(o, load8(ds1[i] + g0, span), c);
                    _mm256_store_ps(corr[r][i], c);
                }
            }
        }
        for (int j = 0; j < span; ++j) {
            const int64_t g = g0 + j;
            __m256i qv[MB], init[MB];
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i) group_activations<F, false>(q[i], lanes[i], g, qv[i], init[i]);
            FLEET_UNROLL
            for (int r = 0; r < R; ++r) {
                const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&t.codes[size_t(r * groups + g) * 32]));
                FLEET_UNROLL
                for (int i = 0; i < MB; ++i) {
                    const __m256i dot = FLEET_DPBUSD(init[i], u, qv[i]);
                    acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(&sd0[r][i][j]), acc[r][i]);
                }
            }
        }
    }
    FLEET_UNROLL
    for (int r = 0; r < R; ++r)  // constant bounds: the accumulators stay in registers
        if (r < rows)
            FLEET_UNROLL
            for (int i = 0; i < MB; ++i)
                p.y[(m + i) * p.ldy + n + r] = hsum(acc[r][i]) + hsum(_mm256_load_ps(corr[r][i]));
}

// Columns [n0, n1) over many activation rows: each tile of 4 weight rows unpacked once (`tile`), then met by
// kPrefillMB activation rows at a time (`wide`) and the rest one by one (`one`), 64 rows a pass.
template <class Tile, class Wide, class One>
static inline void sweep_unpacked(const Product& p, int64_t n0, int64_t n1, Tile* tile, Wide wide, One one) {
    for (int64_t m0 = 0; m0 < p.M; m0 += kRowChunk) {
        const int64_t m1 = std::min(p.M, m0 + kRowChunk);
        for (int64_t n = n0; n < n1; n += 4) {
            const int rows = int(std::min<int64_t>(4, n1 - n));
            tile->unpack(p, n, rows);
            const auto view = tile->view();
            int64_t m = m0;
            for (; m + kPrefillMB <= m1; m += kPrefillMB) wide(p, view, n, rows, m);
            for (; m < m1; ++m) one(p, view, n, rows, m);
        }
    }
}

template <class F>
static void rows_prefill(const Product& p, int64_t n0, int64_t n1) {
    thread_local UnpackedTile<F> buffer;
    sweep_unpacked(p, n0, n1, &buffer, tile_prefill<F, kPrefillMB>, tile_prefill<F, 1>);
}

// The 256-weight types with unsigned codes over many activation rows: a tile of 4 weight rows is unpacked once
// (codes to bytes, each block's scales to registers), then every activation row meets it with the integer and
// float operations of tile_super, in the same order: bitwise the same results. Signed codes (IQ4_XS) keep
// tile_super: their sign is applied to each activation row's values (vpsignb), which nothing can hoist.
struct SuperTileView {  // by plain pointers (see TileView)
    int64_t blocks;
    const uint8_t* codes;
    const SuperScales* scales;
};

template <class F>
struct UnpackedSuperTile {
    static_assert(F::QK == 256 && !F::SIGNED, "see tile_super");
    int64_t blocks = 0;
    std::vector<uint8_t> codes;       // [4][blocks][256]
    std::vector<SuperScales> scales;  // [4][blocks]

    void unpack(const Product& p, int64_t n, int rows) {
        blocks = p.K / 256;
        codes.assign(size_t(4 * blocks * 256), 0);
        scales.assign(size_t(4 * blocks), SuperScales{_mm256_setzero_si256(), _mm256_setzero_si256(), 0.0f, 0.0f});
        for (int r = 0; r < rows; ++r) {
            const uint8_t* row = p.w + (n + r) * p.row_bytes;
            for (int64_t b = 0; b < blocks; ++b) {
                const size_t at = size_t(r * blocks + b);
                F::super(row + b * F::BYTES, scales[at]);
                for (int j = 0; j < 8; ++j)
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&codes[at * 256 + j * 32]), F::codes(row + b * F::BYTES, j));
            }
        }
    }
    SuperTileView view() const { return SuperTileView{blocks, codes.data(), scales.data()}; }
};

template <class F, int MB>
static inline void tile_super_prefill(const Product& p, const SuperTileView& t, int64_t n, int rows, int64_t m) {
    constexpr int R = 4;
    const int64_t blocks = t.blocks;
    const int8_t* q[MB];
    const float* da[MB];
    const int16_t* bsums[MB];
    FLEET_UNROLL
    for (int i = 0; i < MB; ++i) { q[i] = p.a->q_row(m + i); da[i] = p.a->d_row(m + i); bsums[i] = p.a->bsums_row(m + i); }
    alignas(32) float acc[R][MB][8];  // in memory: the integer sums take the registers
    FLEET_UNROLL
    for (int r = 0; r < R; ++r)
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) _mm256_store_ps(acc[r][i], _mm256_setzero_ps());
    for (int64_t b = 0; b < blocks; ++b) {
        const SuperScales* sc[R];
        const uint8_t* codes[R];
        FLEET_UNROLL
        for (int r = 0; r < R; ++r) { sc[r] = &t.scales[r * blocks + b]; codes[r] = &t.codes[size_t(r * blocks + b) * 256]; }
        __m256i isum[R][MB];
        block_sums<F, R, MB>(q, b, [&](int r, int j) { return load32(codes[r] + j * 32); }, sc, isum);
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) {
            const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums[i] + b * 16));
            FLEET_UNROLL
            for (int r = 0; r < R; ++r)
                _mm256_store_ps(acc[r][i], block_end<F>(isum[r][i], *sc[r], bs, da[i][b], _mm256_load_ps(acc[r][i])));
        }
    }
    for (int r = 0; r < rows; ++r)
        FLEET_UNROLL
        for (int i = 0; i < MB; ++i) p.y[(m + i) * p.ldy + n + r] = hsum(_mm256_load_ps(acc[r][i]));
}

template <class F>
static void rows_prefill_super(const Product& p, int64_t n0, int64_t n1) {
    thread_local UnpackedSuperTile<F> buffer;
    sweep_unpacked(p, n0, n1, &buffer, tile_super_prefill<F, kPrefillMB>, tile_super_prefill<F, 1>);
}
