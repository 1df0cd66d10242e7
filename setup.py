"""Builds fleet's kernels (kernels/, C++17) into fleet_common/libfleet_kernels.so with CMake against the pinned
openvino wheel's own CMake config; everything else about the package is in pyproject.toml."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
NEEDS = "a C++17 compiler and make (Debian/Ubuntu: apt-get install g++ make; deploy/setup.sh installs them)"


class Kernels(Extension):
    def __init__(self) -> None:
        super().__init__("fleet_common.libfleet_kernels", sources=[])


class BuildKernels(build_ext):
    """CMake configure + build of kernels/; a failed build says what is missing."""

    def get_ext_filename(self, fullname: str) -> str:
        return fullname.replace(".", os.sep) + ".so"  # a library OpenVINO loads, not a Python module

    def build_extension(self, ext: Extension) -> None:
        import openvino

        ov_cmake = Path(openvino.__file__).parent / "cmake"
        cmake = shutil.which("cmake")
        try:
            import cmake as cmake_pkg  # the pinned PyPI cmake of the build requirements

            cmake = str(Path(cmake_pkg.CMAKE_BIN_DIR) / "cmake")
        except ImportError:
            pass
        if cmake is None:
            raise RuntimeError(f"building fleet's kernels needs cmake and {NEEDS}")
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            raise RuntimeError(f"building fleet's kernels needs {NEEDS}: no C++ compiler found")
        build = Path(self.build_temp) / "kernels"
        build.mkdir(parents=True, exist_ok=True)
        jobs = str(max(1, min(4, os.cpu_count() or 1)))
        steps = [[cmake, "-S", str(HERE / "kernels"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                  f"-DOpenVINO_DIR={ov_cmake}", f"-DTBB_DIR={ov_cmake}"],
                 [cmake, "--build", str(build), "--target", "fleet_kernels", "-j", jobs]]
        for step in steps:
            try:
                subprocess.run(step, check=True)
            except subprocess.CalledProcessError as exc:
                raise RuntimeError(f"building fleet's kernels failed at `{' '.join(step)}` (exit {exc.returncode}); "
                                   f"it needs {NEEDS}, and the output above says what went wrong") from exc
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(build / "libfleet_kernels.so", out)


setup(ext_modules=[Kernels()], cmdclass={"build_ext": BuildKernels})
