// The avx2 kernels. AVX2 has no vpdpbusd: maddubs (u8 x s8 pairs to i16; no pair here can saturate: |u| <= 128, |s| <= 127, 2 x 128 x 127 < 32767) then madd against ones, exact.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "product.h"

namespace fleet {
namespace avx2 {

#define FLEET_DPBUSD(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define FLEET_DPWSSD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#define FLEET_VNNI 0  // a real vpdpbusd: u8 codes up to 255 do not saturate
#define FLEET_WIDE_REGISTERS 0  // 32 vector registers (EVEX)
#include "x86/unpack.h"
#include "x86/driver.h"
#include "x86/sparse.h"
#undef FLEET_DPBUSD
#undef FLEET_DPWSSD
#undef FLEET_VNNI
#undef FLEET_WIDE_REGISTERS

}  // namespace avx2

const KernelTable& avx2_kernels() {
    static const KernelTable table = avx2::with_sparse(avx2::make_table("avx2"));
    return table;
}

}  // namespace fleet
