// The avxvnni kernels. AVX-VNNI (VEX vpdpbusd): Intel Core Ultra and other Alder Lake or newer CPUs without AVX-512. Compiled without any AVX-512 flag, so the object holds no EVEX instruction (a test disassembles it).
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "product.h"

namespace fleet {
namespace avxvnni {

#define FLEET_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#include "x86/unpack.h"
#include "x86/driver.h"
#undef FLEET_DPBUSD

}  // namespace avxvnni

const KernelTable& avxvnni_kernels() {
    static const KernelTable table = avxvnni::make_table("avxvnni");
    return table;
}

}  // namespace fleet
