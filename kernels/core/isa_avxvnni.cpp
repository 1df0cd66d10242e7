// The avxvnni kernels. AVX-VNNI (VEX vpdpbusd): Intel Core Ultra and other Alder Lake or newer CPUs without AVX-512. Compiled without any AVX-512 flag, so the object holds no EVEX instruction (a test disassembles it).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "product.h"

namespace fleet {
namespace avxvnni {

#define FLEET_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define FLEET_DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#define FLEET_VNNI 1  // a real vpdpbusd: u8 codes up to 255 do not saturate
#define FLEET_WIDE_REGISTERS 0  // 32 vector registers (EVEX)
#include "x86/unpack.h"
#include "x86/driver.h"
#undef FLEET_DPBUSD
#undef FLEET_DPWSSD
#undef FLEET_VNNI
#undef FLEET_WIDE_REGISTERS

}  // namespace avxvnni

namespace {

// The sparse FFN's kernels are AVX2's: no VNNI instruction helps them (the gate's activation and the axpy are
// float arithmetic: f32 fmas of converted codes), and those kernels hold no EVEX instruction.
KernelTable with_avx2_sparse(KernelTable t) {
    const KernelTable& avx2 = avx2_kernels();
    t.activate = avx2.activate;
    for (int id = 0; id < kNumTypeIds; ++id) t.axpy[id] = avx2.axpy[id];
    return t;
}

}  // namespace

const KernelTable& avxvnni_kernels() {
    static const KernelTable table = with_avx2_sparse(avxvnni::make_table("avxvnni"));
    return table;
}

}  // namespace fleet
