// The blocks of each GGUF integer type unpacked into 256-bit registers: 32 codes of a sub-block (unsigned,
// or signed for the symmetric types) and, per block, its scales and offsets (w = s c + o per 16 weights).
// Included by one instruction set's file at a time (isa_*.cpp), inside that set's namespace.
//
// Each type says how its offset is applied: ZSHIFT >= 0 is an integer zero point z = 2^ZSHIFT (w = s (c - z):
// subtracted exactly in the integer dot, see activations.h), OFFSET a float offset per half (w = s c + o:
// added as o x d x sum(q)), SIGNED signed codes (no offset). span() reads the scales of the 8 sub-blocks of
// 32 that start at `blk` (8 blocks of a 32-weight type, or one block of 256) into s0/s1 (first/second half
// of each sub-block; PER16 types only differ) and o0/o1; entries past `span` are 0.
// Layouts: formats.cpp, the scalar reference these are tested against.

struct Layout32 {  // the 32-weight types
    static constexpr int QK = 32, SUBS = 1;
    static constexpr bool HALVES = false;  // see Layout256
    static constexpr int NIBBLES = -1;  // the plain-nibble types say where their nibbles start
};
struct Layout256 {  // the K-quants and IQ4_XS
    static constexpr int QK = 256, SUBS = 8;
    // HALVES: each block's integer sums are kept per half of its sub-blocks, an output column a lane in prefill
    // (driver.h kSuperHalves; CODE_BITS then says how many bits a code takes).
    static constexpr bool HALVES = false;
};

static inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline float f16(const uint8_t* p) { return _cvtsh_ss(uint16_t(p[0] | (p[1] << 8))); }
static inline __m256i mask8(int v) { return _mm256_set1_epi8(char(v)); }
static inline __m256i shr16(__m256i v, int bits) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits)); }

// 16 bytes of nibbles -> 32 codes: code j is the low nibble of byte j, code j + 16 its high nibble.
// One broadcast load (no shuffle), the upper lane shifted by 4 bits (a per-dword shift: the bits it brings in
// from the next byte are masked off).
static inline __m256i nibbles32(const uint8_t* qs) {
    const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    return _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), mask8(15));
}

// 16 bytes of nibbles -> the low nibbles (codes 0..15) in the low lane and the high nibbles in place (16 x codes
// 16..31) in the high lane: one broadcast load and one AND. For a real vpdpbusd only (16 c up to 240 would
// saturate AVX2's vpmaddubsw); the high lanes' dot products are then 16 times the codes', which the kernel
// undoes exactly at the end (a power of two).
static inline __m256i nibble_halves(const uint8_t* qs) {
    const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    return _mm256_and_si256(x, _mm256_setr_epi64x(0x0f0f0f0f0f0f0f0fLL, 0x0f0f0f0f0f0f0f0fLL,
                                                  int64_t(0xf0f0f0f0f0f0f0f0ULL), int64_t(0xf0f0f0f0f0f0f0f0ULL)));
}

// 32 bits -> 32 bytes: byte j is `value` where bit j is set, else 0.
static inline __m256i bits32(uint32_t bits, int value) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(int(bits)), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), mask8(value));
}

static inline __m256i lookup(const int8_t* table16, __m256i nibbles) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table16));
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), nibbles);
}

static inline uint32_t le32(const uint8_t* p) { uint32_t v; __builtin_memcpy(&v, p, 4); return v; }
static inline uint16_t le16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

// The f16 at `p` in each of `span` blocks of `stride` bytes, as 8 floats (0 past span).
__attribute__((always_inline)) static inline void f16_span(const uint8_t* p, int stride, int span, float* out) {
    if (span == 8) {  // in registers: no store-to-load forwarding stall
        __m128i h = _mm_cvtsi32_si128(le16(p));
        h = _mm_insert_epi16(h, le16(p + stride), 1);
        h = _mm_insert_epi16(h, le16(p + 2 * stride), 2);
        h = _mm_insert_epi16(h, le16(p + 3 * stride), 3);
        h = _mm_insert_epi16(h, le16(p + 4 * stride), 4);
        h = _mm_insert_epi16(h, le16(p + 5 * stride), 5);
        h = _mm_insert_epi16(h, le16(p + 6 * stride), 6);
        h = _mm_insert_epi16(h, le16(p + 7 * stride), 7);
        _mm256_store_ps(out, _mm256_cvtph_ps(h));
        return;
    }
    alignas(16) uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < span; ++j) h[j] = le16(p + j * stride);
    _mm256_store_ps(out, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h))));
}

struct FQ4_0 : Layout32 {
    static constexpr int BYTES = 18; static constexpr bool SIGNED = false, PER16 = false;
    static constexpr int ZSHIFT = 3; static constexpr bool OFFSET = false;
    static constexpr int NIBBLES = 2;  // where the 16 bytes of nibbles start (types of plain nibbles only)
    static inline void span(const uint8_t* b, int n, float* s0, float*, float*, float*) { f16_span(b, BYTES, n, s0); }
    static inline __m256i codes(const uint8_t* b, int) { return nibbles32(b + NIBBLES); }
};
struct FQ4_1 : Layout32 {
    static constexpr int BYTES = 20; static constexpr bool SIGNED = false, PER16 = false;
    static constexpr int ZSHIFT = -1; static constexpr bool OFFSET = true;
    static constexpr int NIBBLES = 4;
    static inline void span(const uint8_t* b, int n, float* s0, float*, float* o0, float*) {
        f16_span(b, BYTES, n, s0);
        f16_span(b + 2, BYTES, n, o0);
    }
    static inline __m256i codes(const uint8_t* b, int) { return nibbles32(b + NIBBLES); }
};
struct FQ5_0 : Layout32 {
    static constexpr int BYTES = 22; static constexpr bool SIGNED = false, PER16 = false;
    static constexpr int ZSHIFT = 4; static constexpr bool OFFSET = false;
    static inline void span(const uint8_t* b, int n, float* s0, float*, float*, float*) { f16_span(b, BYTES, n, s0); }
    static inline __m256i codes(const uint8_t* b, int) { return _mm256_or_si256(nibbles32(b + 6), bits32(le32(b + 2), 16)); }
};
struct FQ5_1 : Layout32 {
    static constexpr int BYTES = 24; static constexpr bool SIGNED = false, PER16 = false;
    static constexpr int ZSHIFT = -1; static constexpr bool OFFSET = true;
    static inline void span(const uint8_t* b, int n, float* s0, float*, float* o0, float*) {
        f16_span(b, BYTES, n, s0);
        f16_span(b + 2, BYTES, n, o0);
    }
    static inline __m256i codes(const uint8_t* b, int) { return _mm256_or_si256(nibbles32(b + 8), bits32(le32(b + 4), 16)); }
};
struct FQ8_0 : Layout32 {
    static constexpr int BYTES = 34; static constexpr bool SIGNED = true, PER16 = false;
    static constexpr int ZSHIFT = -1; static constexpr bool OFFSET = false;
    static inline void span(const uint8_t* b, int n, float* s0, float*, float*, float*) { f16_span(b, BYTES, n, s0); }
    static inline __m256i codes(const uint8_t* b, int) { return load32(b + 2); }
};
struct FIQ4_NL : Layout32 {
    static constexpr int BYTES = 18; static constexpr bool SIGNED = true, PER16 = false;
    static constexpr int ZSHIFT = -1; static constexpr bool OFFSET = false;
    static inline void span(const uint8_t* b, int n, float* s0, float*, float*, float*) { f16_span(b, BYTES, n, s0); }
    static inline __m256i codes(const uint8_t* b, int) { return lookup(kIq4Values, nibbles32(b + 2)); }
};
struct FMXFP4 : Layout32 {
    static constexpr int BYTES = 17; static constexpr bool SIGNED = true, PER16 = false;
    static constexpr int ZSHIFT = -1; static constexpr bool OFFSET = false;
    static inline void span(const uint8_t* b, int n, float* s0, float*, float*, float*) {
        for (int j = 0; j < 8; ++j) {  // E8M0 exponent e: 2^(e - 128), E2M1's halving folded in
            const uint8_t e = j < n ? b[j * BYTES] : 0;
            const uint32_t bits = j >= n ? 0u : e < 2 ? (0x00200000u << e) : (uint32_t(e - 1) << 23);
            __builtin_memcpy(&s0[j], &bits, 4);
        }
    }
    static inline __m256i codes(const uint8_t* b, int) { return lookup(kE2m1Doubled, nibbles32(b + 1)); }
};

// A 256-weight block's integer form in registers (formats.h IntegerScales): int16 scales and minimums per 16
// weights in the order s0, s2, ..., s14 | s1, s3, ..., s15 (the activations' bsums order, activations.h), so
// that one in-lane shuffle gives sub-block j's scales (s2j in the low lane: its first 16 weights, s2j+1 in
// the high lane) and one vpmaddwd against the bsums gives sum scale[g] b[g].
struct SuperScales {
    __m256i scales, mins;
    float d, dmin;
};

// The 256-weight types: the scales of one block's 8 sub-blocks (Q4_K, Q5_K and Q6_K unpacked here, the
// rarer ones by the scalar reference, once per 256 weights).
template <BlockType T>
struct KScales {
    static inline void super(const uint8_t* b, SuperScales& out) {  // by the scalar reference, reordered
        static const Format* const f = format_by_type(int(T));
        IntegerScales is;
        integer_scales(*f, b, is);
        alignas(32) int16_t sc[16], mn[16];
        for (int g = 0; g < 16; ++g) { sc[bsum_slot(g)] = is.scale[g]; mn[bsum_slot(g)] = is.min[g]; }
        out.scales = _mm256_load_si256(reinterpret_cast<const __m256i*>(sc));
        out.mins = _mm256_load_si256(reinterpret_cast<const __m256i*>(mn));
        out.d = is.d;
        out.dmin = is.dmin;
    }
    static inline void span(const uint8_t* b, int, float* s0, float* s1, float* o0, float* o1) {
        static const Format* const f = format_by_type(int(T));
        float s[16], o[16];
        block_scales(*f, b, s, o);
        for (int j = 0; j < 8; ++j) {
            s0[j] = s[2 * j]; s1[j] = s[2 * j + 1];
            o0[j] = o[2 * j]; o1[j] = o[2 * j + 1];
        }
    }
};
struct K4Scales {  // Q4_K, Q5_K: d, dmin, then 8 x (6-bit scale, 6-bit min) in 12 bytes, unpacked in 32-bit words
    static inline void unpack_scales(const uint8_t* b, uint64_t& sc, uint64_t& mn) {  // byte j: sub-block j's
        const uint32_t w0 = le32(b + 4), w1 = le32(b + 8), w2 = le32(b + 12);
        sc = uint64_t(w0 & 0x3f3f3f3fu) | uint64_t((w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u)) << 32;
        mn = uint64_t(w1 & 0x3f3f3f3fu) | uint64_t(((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u)) << 32;
    }
    static inline void span(const uint8_t* b, int, float* s0, float*, float* o0, float*) {
        uint64_t sc, mn;
        unpack_scales(b, sc, mn);
        const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc))));
        const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn))));
        _mm256_store_ps(s0, _mm256_mul_ps(_mm256_set1_ps(f16(b)), scf));
        _mm256_store_ps(o0, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), mnf)));
    }
    // In one 16-byte register (d, dmin, then the 12 bytes s0..s11): byte j of `r` is scale j, byte 8 + j min j:
    //   j < 4: s[j] & 63, s[j + 4] & 63;   j >= 4: (s[j + 4] & 15) | (s[j - 4] >> 6) << 4, (s[j + 4] >> 4) | (s[j] >> 6) << 4
    static inline void super(const uint8_t* b, SuperScales& out) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
        const __m128i none = _mm_set1_epi8(char(0x80));
        const __m128i low = _mm_and_si128(_mm_shuffle_epi8(x, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 0, 0, 0, 0)),
                                          _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
        const __m128i nibble = _mm_and_si128(_mm_srli_epi16(x, 4), _mm_set1_epi8(15));
        const __m128i min_low = _mm_shuffle_epi8(nibble, _mm_blend_epi16(none, _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 13, 14, 15), 0xC0));
        const __m128i top = _mm_and_si128(_mm_srli_epi16(x, 2), _mm_set1_epi8(0x30));  // (byte >> 6) << 4
        const __m128i high = _mm_shuffle_epi8(top, _mm_setr_epi8(-128, -128, -128, -128, 4, 5, 6, 7, -128, -128, -128, -128, 8, 9, 10, 11));
        const __m128i r = _mm_or_si128(_mm_or_si128(low, min_low), high);
        out.scales = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(r, r));  // a scale per 32: both halves alike
        out.mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi64(r, r));
        const __m128 dd = _mm_cvtph_ps(x);  // d, dmin
        out.d = _mm_cvtss_f32(dd);
        out.dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
    }
};

struct FQ4_K : Layout256, K4Scales {
    static constexpr int BYTES = 144, CODE_BITS = 4; static constexpr bool SIGNED = false, PER16 = false, HALVES = true;
    static constexpr int ZSHIFT = -1; static constexpr bool OFFSET = true;
    static inline __m256i codes(const uint8_t* b, int sub) {
        return _mm256_and_si256(shr16(load32(b + 16 + (sub / 2) * 32), 4 * (sub % 2)), mask8(15));
    }
};
struct FQ5_K : Layout256, K4Scales {
    static constexpr int BYTES = 176, CODE_BITS = 5; static constexpr bool SIGNED = false, PER16 = false, HALVES = true;
    static constexpr int ZSHIFT = -1; static constexpr bool OFFSET = true;
    static inline __m256i codes(const uint8_t* b, int sub) {
        const __m256i low = _mm256_and_si256(shr16(load32(b + 48 + (sub / 2) * 32), 4 * (sub % 2)), mask8(15));
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(shr16(load32(b + 16), sub), mask8(1)), 4);
        return _mm256_or_si256(low, high);
    }
};
struct FQ6_K : Layout256 {
    static constexpr int BYTES = 210, CODE_BITS = 6; static constexpr bool SIGNED = false, PER16 = true, HALVES = true;
    static constexpr int ZSHIFT = 5; static constexpr bool OFFSET = false;
    static inline __m128i even_odd_scales(const uint8_t* b) {  // int8 scales[16] at 192: s0, s2, .., s14, s1, s3, ..
        return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)),
                                _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    }
    static inline void super(const uint8_t* b, SuperScales& out) {
        out.scales = _mm256_cvtepi8_epi16(even_odd_scales(b));
        out.mins = _mm256_setzero_si256();
        out.d = f16(b + 208);
        out.dmin = 0.0f;
    }
    static inline void span(const uint8_t* b, int, float* s0, float* s1, float*, float*) {
        const __m128i sc = even_odd_scales(b);
        const __m256 d = _mm256_set1_ps(f16(b + 208));
        _mm256_store_ps(s0, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_store_ps(s1, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    }
    static inline __m256i codes(const uint8_t* b, int sub) {
        const int half = sub / 4, t = sub % 4;
        const __m256i low = _mm256_and_si256(shr16(load32(b + half * 64 + (t % 2) * 32), 4 * (t / 2)), mask8(15));
        const __m256i high = _mm256_and_si256(shr16(load32(b + 128 + half * 32), 2 * t), mask8(3));
        return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
};
struct FQ3_K : Layout256, KScales<BlockType::Q3_K> {
    static constexpr int BYTES = 110; static constexpr bool SIGNED = false, PER16 = true;
    static constexpr int ZSHIFT = 2; static constexpr bool OFFSET = false;
    static inline __m256i codes(const uint8_t* b, int sub) {
        const int half = sub / 4, t = sub % 4;
        const __m256i low = _mm256_and_si256(shr16(load32(b + 32 + half * 32), 2 * t), mask8(3));
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(shr16(load32(b), sub), mask8(1)), 2);
        return _mm256_or_si256(low, high);
    }
};
struct FQ2_K : Layout256, KScales<BlockType::Q2_K> {
    static constexpr int BYTES = 84; static constexpr bool SIGNED = false, PER16 = true;
    static constexpr int ZSHIFT = -1; static constexpr bool OFFSET = true;
    static inline __m256i codes(const uint8_t* b, int sub) {
        return _mm256_and_si256(shr16(load32(b + 16 + (sub / 4) * 32), 2 * (sub % 4)), mask8(3));
    }
};
struct FIQ4_XS : Layout256, KScales<BlockType::IQ4_XS> {
    static constexpr int BYTES = 136; static constexpr bool SIGNED = true, PER16 = false;
    static constexpr int ZSHIFT = -1; static constexpr bool OFFSET = false;
    static inline __m256i codes(const uint8_t* b, int sub) { return lookup(kIq4Values, nibbles32(b + 8 + sub * 16)); }
};
