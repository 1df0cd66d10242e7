// The blocks of each GGUF integer type unpacked into 256-bit registers: 32 codes of a sub-block (unsigned,
// or signed for the symmetric types) and, per block, its scales and offsets (w = s c + o per 16 weights).
// Included by one instruction set's file at a time (isa_*.cpp), inside that set's namespace.
// Layouts: formats.cpp, the scalar reference these are tested against.

struct Layout32 {  // the 32-weight types
    static constexpr int QK = 32, SUBS = 1;
};
struct Layout256 {  // the K-quants and IQ4_XS
    static constexpr int QK = 256, SUBS = 8;
};

static inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline float f16(const uint8_t* p) { return _cvtsh_ss(uint16_t(p[0] | (p[1] << 8))); }
static inline __m256i mask8(int v) { return _mm256_set1_epi8(char(v)); }
static inline __m256i shr16(__m256i v, int bits) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits)); }

// 16 bytes of nibbles -> 32 codes: code j is the low nibble of byte j, code j + 16 its high nibble.
static inline __m256i nibbles32(const uint8_t* qs) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), mask8(15));
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

struct FQ4_0 : Layout32 {
    static constexpr int BYTES = 18; static constexpr bool SIGNED = false, PER16 = false;
    static inline void scales(const uint8_t* b, float* s, float* o) { s[0] = s[1] = f16(b); o[0] = o[1] = -8.0f * s[0]; }
    static inline __m256i codes(const uint8_t* b, int) { return nibbles32(b + 2); }
};
struct FQ4_1 : Layout32 {
    static constexpr int BYTES = 20; static constexpr bool SIGNED = false, PER16 = false;
    static inline void scales(const uint8_t* b, float* s, float* o) { s[0] = s[1] = f16(b); o[0] = o[1] = f16(b + 2); }
    static inline __m256i codes(const uint8_t* b, int) { return nibbles32(b + 4); }
};
struct FQ5_0 : Layout32 {
    static constexpr int BYTES = 22; static constexpr bool SIGNED = false, PER16 = false;
    static inline void scales(const uint8_t* b, float* s, float* o) { s[0] = s[1] = f16(b); o[0] = o[1] = -16.0f * s[0]; }
    static inline __m256i codes(const uint8_t* b, int) { return _mm256_or_si256(nibbles32(b + 6), bits32(le32(b + 2), 16)); }
};
struct FQ5_1 : Layout32 {
    static constexpr int BYTES = 24; static constexpr bool SIGNED = false, PER16 = false;
    static inline void scales(const uint8_t* b, float* s, float* o) { s[0] = s[1] = f16(b); o[0] = o[1] = f16(b + 2); }
    static inline __m256i codes(const uint8_t* b, int) { return _mm256_or_si256(nibbles32(b + 8), bits32(le32(b + 4), 16)); }
};
struct FQ8_0 : Layout32 {
    static constexpr int BYTES = 34; static constexpr bool SIGNED = true, PER16 = false;
    static inline void scales(const uint8_t* b, float* s, float* o) { s[0] = s[1] = f16(b); o[0] = o[1] = 0.0f; }
    static inline __m256i codes(const uint8_t* b, int) { return load32(b + 2); }
};
struct FIQ4_NL : Layout32 {
    static constexpr int BYTES = 18; static constexpr bool SIGNED = true, PER16 = false;
    static inline void scales(const uint8_t* b, float* s, float* o) { s[0] = s[1] = f16(b); o[0] = o[1] = 0.0f; }
    static inline __m256i codes(const uint8_t* b, int) { return lookup(kIq4Values, nibbles32(b + 2)); }
};
struct FMXFP4 : Layout32 {
    static constexpr int BYTES = 17; static constexpr bool SIGNED = true, PER16 = false;
    static inline void scales(const uint8_t* b, float* s, float* o) {
        const uint32_t bits = b[0] < 2 ? (0x00200000u << b[0]) : (uint32_t(b[0] - 1) << 23);  // 2^(e - 128)
        __builtin_memcpy(&s[0], &bits, 4);
        s[1] = s[0];
        o[0] = o[1] = 0.0f;
    }
    static inline __m256i codes(const uint8_t* b, int) { return lookup(kE2m1Doubled, nibbles32(b + 1)); }
};

// The 256-weight types read their scales with the scalar reference (once per 256 weights).
template <BlockType T>
struct KScales {
    static inline void scales(const uint8_t* b, float* s, float* o) { block_scales(*format_by_type(int(T)), b, s, o); }
};

struct FQ4_K : Layout256, KScales<BlockType::Q4_K> {
    static constexpr int BYTES = 144; static constexpr bool SIGNED = false, PER16 = false;
    static inline __m256i codes(const uint8_t* b, int sub) {
        return _mm256_and_si256(shr16(load32(b + 16 + (sub / 2) * 32), 4 * (sub % 2)), mask8(15));
    }
};
struct FQ5_K : Layout256, KScales<BlockType::Q5_K> {
    static constexpr int BYTES = 176; static constexpr bool SIGNED = false, PER16 = false;
    static inline __m256i codes(const uint8_t* b, int sub) {
        const __m256i low = _mm256_and_si256(shr16(load32(b + 48 + (sub / 2) * 32), 4 * (sub % 2)), mask8(15));
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(shr16(load32(b + 16), sub), mask8(1)), 4);
        return _mm256_or_si256(low, high);
    }
};
struct FQ6_K : Layout256, KScales<BlockType::Q6_K> {
    static constexpr int BYTES = 210; static constexpr bool SIGNED = false, PER16 = true;
    static inline __m256i codes(const uint8_t* b, int sub) {
        const int half = sub / 4, t = sub % 4;
        const __m256i low = _mm256_and_si256(shr16(load32(b + half * 64 + (t % 2) * 32), 4 * (t / 2)), mask8(15));
        const __m256i high = _mm256_and_si256(shr16(load32(b + 128 + half * 32), 2 * t), mask8(3));
        return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
    }
};
struct FQ3_K : Layout256, KScales<BlockType::Q3_K> {
    static constexpr int BYTES = 110; static constexpr bool SIGNED = false, PER16 = true;
    static inline __m256i codes(const uint8_t* b, int sub) {
        const int half = sub / 4, t = sub % 4;
        const __m256i low = _mm256_and_si256(shr16(load32(b + 32 + half * 32), 2 * t), mask8(3));
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(shr16(load32(b), sub), mask8(1)), 2);
        return _mm256_or_si256(low, high);
    }
};
struct FQ2_K : Layout256, KScales<BlockType::Q2_K> {
    static constexpr int BYTES = 84; static constexpr bool SIGNED = false, PER16 = true;
    static inline __m256i codes(const uint8_t* b, int sub) {
        return _mm256_and_si256(shr16(load32(b + 16 + (sub / 4) * 32), 2 * (sub % 4)), mask8(3));
    }
};
struct FIQ4_XS : Layout256, KScales<BlockType::IQ4_XS> {
    static constexpr int BYTES = 136; static constexpr bool SIGNED = true, PER16 = false;
    static inline __m256i codes(const uint8_t* b, int sub) { return lookup(kIq4Values, nibbles32(b + 8 + sub * 16)); }
};
