// Stands in for the kernels of an instruction set that the sanitizer check was built without (kernels/CMakeLists.txt
// FLEET_KERNELS_SAN_ISAS: the sets the CPU building it runs; the others' code would never run there). The check
// asks for a set's table only after cpu_has() says the CPU runs it, so these are never called on that CPU.
#include <stdexcept>

#include "product.h"

namespace fleet {

#ifdef FLEET_ABSENT_AVXVNNI
const KernelTable& avxvnni_kernels() { throw std::runtime_error("avxvnni kernels: not built into this check"); }
#endif
#ifdef FLEET_ABSENT_AVX512VNNI
const KernelTable& avx512vnni_kernels() { throw std::runtime_error("avx512vnni kernels: not built into this check"); }
#endif

}  // namespace fleet
