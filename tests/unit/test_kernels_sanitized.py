"""fleet's kernels under AddressSanitizer and UndefinedBehaviorSanitizer: kernels/tests/check.cpp (every kernel of
every instruction set this CPU runs against the scalar one, odd shapes, both modes, rows alone and batched) built
with -fsanitize=address,undefined from kernels/CMakeLists.txt (FLEET_KERNELS_SANITIZE, no OpenVINO needed) and run;
any out-of-bounds read, overflow or disagreement fails the test with the tool's report."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def runnable_isas() -> list[str]:
    """The SIMD sets of kernels/core/dispatch.cpp this CPU runs, by /proc/cpuinfo's flags (every set where it
    cannot be read): the sanitizer build compiles only those (the others' code would not run here)."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return ["avx2", "avxvnni", "avx512vnni"]
    avx512 = {"avx512f", "avx512vl", "avx512bw", "avx512_vnni"} <= flags
    return ["avx2", *(["avxvnni"] if "avx_vnni" in flags else []), *(["avx512vnni"] if avx512 else [])]


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None, reason="needs cmake and a C++ compiler")
def test_every_kernel_is_clean_under_the_sanitizers(tmp_path: Path) -> None:
    build = tmp_path / "san"
    subprocess.run(["cmake", "-S", str(ROOT / "kernels"), "-B", str(build), "-DFLEET_KERNELS_SANITIZE=ON",
                    "-DFLEET_KERNELS_EXTENSION=OFF", "-DCMAKE_BUILD_TYPE=Debug",
                    f"-DFLEET_KERNELS_SAN_ISAS={';'.join(runnable_isas())}"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "kernels_check", "-j", "2"], check=True,
                   capture_output=True)
    run = subprocess.run([str(build / "kernels_check")], capture_output=True, text=True, timeout=600,
                         env={"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    assert " 0 failures" in run.stdout and "runtime error" not in run.stderr, run.stdout + run.stderr
    checks = int(run.stdout.split(" checks")[0].split()[-1])
    assert checks >= 16 * 3 * 2 * 2, run.stdout  # every type, shapes, both modes, at least AVX2 and one VNNI set
