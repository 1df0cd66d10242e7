// The one place an instruction set is chosen: by CPUID, or by FLEET_KERNEL_ISA (tests, benches).
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "product.h"

namespace fleet {

bool cpu_has(const char* isa) {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (std::strcmp(isa, "scalar") == 0) return true;
    if (std::strcmp(isa, "avx2") == 0) return avx2;
    if (std::strcmp(isa, "avxvnni") == 0) return avx2 && __builtin_cpu_supports("avxvnni");
    if (std::strcmp(isa, "avx512vnni") == 0)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    return false;
}

namespace {

const KernelTable& by_name(const std::string& name) {
    if (name == "scalar") return scalar_kernels();
    if (name == "avx2") return avx2_kernels();
    if (name == "avxvnni") return avxvnni_kernels();
    if (name == "avx512vnni") return avx512vnni_kernels();
    throw std::runtime_error("FLEET_KERNEL_ISA=" + name + " is not one of scalar, avx2, avxvnni, avx512vnni");
}

// A set's table is built only once the CPU is known to run it: building it runs code compiled for that set (the
// compiler may copy a table with its widest registers).
const KernelTable& choose() {
    if (const char* forced = std::getenv("FLEET_KERNEL_ISA"); forced != nullptr && *forced != '\0') {
        if (!cpu_has(forced)) {
            for (const char* isa : {"scalar", "avx2", "avxvnni", "avx512vnni"})
                if (std::strcmp(isa, forced) == 0)
                    throw std::runtime_error(std::string("FLEET_KERNEL_ISA=") + forced + ": this CPU does not have it");
            by_name(forced);  // throws: not a set's name
        }
        return by_name(forced);
    }
    for (const char* isa : {"avx512vnni", "avxvnni", "avx2"})
        if (cpu_has(isa)) return by_name(isa);
    return scalar_kernels();
}

}  // namespace

const KernelTable& active_kernels() { return choose(); }  // read at each product: tests switch it

RowsKernel select_kernel(const Product& p) {
    const int id = int(p.fmt->type);
    const KernelTable& table = active_kernels();
    RowsKernel k = p.exact ? table.exact[id] : table.quantized[id];
    if (k == nullptr) k = p.exact ? scalar_kernels().exact[id] : scalar_kernels().quantized[id];
    return k;
}

AxpyKernel select_axpy(const Format& f) {
    const int id = int(f.type);
    const AxpyKernel k = active_kernels().axpy[id];
    return k != nullptr ? k : scalar_kernels().axpy[id];
}

ActivateKernel select_activate() {
    const ActivateKernel k = active_kernels().activate;
    return k != nullptr ? k : scalar_kernels().activate;
}

}  // namespace fleet
