// The avx512vnni kernels. AVX-512 VNNI on 256-bit registers (EVEX vpdpbusd with VL): 256-bit vectors measured as fast as 512-bit on Zen 4, and the same source as the AVX-VNNI build.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "product.h"

namespace fleet {
namespace avx512vnni {

#define FLEET_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#include "x86/unpack.h"
#include "x86/driver.h"
#undef FLEET_DPBUSD

}  // namespace avx512vnni

const KernelTable& avx512vnni_kernels() {
    static const KernelTable table = avx512vnni::make_table("avx512vnni");
    return table;
}

}  // namespace fleet
