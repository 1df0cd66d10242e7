// The avx512vnni kernels. AVX-512 VNNI on 256-bit registers (EVEX vpdpbusd with VL): 256-bit vectors measured as
// fast as 512-bit on Zen 4, and the same source as the AVX-VNNI build; the K-quants' prefill column tile on 512-bit
// registers (x86/columns512.h: twice as wide on Intel's server cores, the same bits).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "product.h"

namespace fleet {
namespace avx512vnni {

#define FLEET_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define FLEET_DPWSSD(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#define FLEET_VNNI 1  // a real vpdpbusd: u8 codes up to 255 do not saturate
#define FLEET_WIDE_REGISTERS 1  // 32 vector registers (EVEX)
#define FLEET_COLUMNS_512 1  // the K-quants' column tile on 512-bit registers (x86/columns512.h)
#include "x86/unpack.h"
#include "x86/driver.h"
#include "x86/sparse.h"
#undef FLEET_DPBUSD
#undef FLEET_DPWSSD
#undef FLEET_VNNI
#undef FLEET_WIDE_REGISTERS
#undef FLEET_COLUMNS_512

}  // namespace avx512vnni

const KernelTable& avx512vnni_kernels() {
    static const KernelTable table = avx512vnni::with_sparse(avx512vnni::make_table("avx512vnni"));
    return table;
}

}  // namespace fleet
