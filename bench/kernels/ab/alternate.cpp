// bench/kernels/kernel_ab.py's timer: two builds of fleet's kernels (time_product.cpp, one shared library each)
// loaded into one process and called alternately, so that both see the same seconds of a noisy host.
//   alternate LIB_A LIB_B TYPE N K ROWS ROUNDS REPS  ->  one line: "A_SECONDS B_SECONDS" per round
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

using Seconds = double (*)(const char*, long, long, long, int);

int main(int argc, char** argv) {
    if (argc != 9) {
        std::fprintf(stderr, "usage: %s LIB_A LIB_B TYPE N K ROWS ROUNDS REPS\n", argv[0]);
        return 2;
    }
    Seconds run[2];
    for (int i = 0; i < 2; ++i) {
        void* lib = dlopen(argv[1 + i], RTLD_NOW | RTLD_LOCAL);  // local: the two builds' symbols stay apart
        if (lib == nullptr || (run[i] = reinterpret_cast<Seconds>(dlsym(lib, "fleet_ab_seconds"))) == nullptr) {
            std::fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
    }
    const char* type = argv[3];
    const long n = std::atol(argv[4]), k = std::atol(argv[5]), rows = std::atol(argv[6]);
    const int rounds = std::atoi(argv[7]), reps = std::atoi(argv[8]);
    for (int r = 0; r < rounds; ++r) {
        const double a = run[0](type, n, k, rows, reps), b = run[1](type, n, k, rows, reps);
        if (a <= 0 || b <= 0) {
            std::fprintf(stderr, "%s: not a type both builds run at K = %ld\n", type, k);
            return 1;
        }
        std::printf("%.9f %.9f\n", a, b);
        std::fflush(stdout);
    }
    return 0;
}
