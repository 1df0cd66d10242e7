#!/usr/bin/env bash
# Build llama.cpp's llama-server and rpc-server (RPC backend on, CPU, native ISA) for the comparison in
# bench/pipeline/interleave_bench.py --llama-cpp, llama-quantize for the K-quant GGUFs of
# bench/builds/gguf_forms.py and bench/real_gguf.py, and llama-bench for bench/kernels/kernel_bench.py. The source
# is the llama.cpp vendored in PyPI's llama-cpp-python sdist at a pinned version (the machine reaches PyPI, not GitHub). Nothing lands in the repository:
# the build goes to $LLAMA_CPP_DIR (default ~/.cache/fleet/llama.cpp). Idempotent: a finished build at
# the same version only prints the binaries' paths. About 5 minutes on 2 cores (5 min 10 s here).
#   bench/build_llama_cpp.sh            # then: bench/pipeline/interleave_bench.py --llama-cpp
#   LLAMA_CPP_DIR=/tmp/lc JOBS=4 bench/build_llama_cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=${LLAMA_CPP_DIR:-$HOME/.cache/fleet/llama.cpp}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
SRC="$DIR/src-$VERSION"
OUT="$DIR/build-$VERSION-noamx"  # the build below (AMX off: see there)
BIN="$OUT/bin"

if [ -x "$BIN/llama-server" ] && [ -x "$BIN/rpc-server" ] && [ -x "$BIN/llama-quantize" ] && [ -x "$BIN/llama-bench" ]; then
  echo "llama-server: $BIN/llama-server"; echo "rpc-server: $BIN/rpc-server"
  echo "llama-quantize: $BIN/llama-quantize"; echo "llama-bench: $BIN/llama-bench"; exit 0
fi

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=$( [ "$(id -u)" = 0 ] && echo "" || echo sudo )
  echo "installing ${missing[*]} with apt-get" >&2
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

mkdir -p "$DIR"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  tmp=$(mktemp -d "$DIR/.download.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  "$PYTHON" -m pip download --disable-pip-version-check -q --no-binary :all: --no-deps \
    -d "$tmp" "llama-cpp-python==$VERSION"
  tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  rm -rf "$SRC"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
fi

# GGML_NATIVE: the kernels for this CPU (llama.cpp's own default build). This version has no libcurl
# (LLAMA_CURL is deprecated and ignored); LLAMA_OPENSSL off so no libssl-dev is needed: we serve loopback.
# The RPC server's target is ggml-rpc-server here (rpc-server in older trees); we link it as rpc-server.
# A build from before llama-quantize or llama-bench was listed only builds those targets (cmake's build is incremental).
# Without AMX: on an AMX Xeon VM here (2026-12) ggml's AMX matmul died at its first tile instruction (SIGILL in
# ggml_backend_amx_mul_mat, llama-server's warm-up) although AMX itself ran there; so llama.cpp is compared on
# what runs, its AVX-512 VNNI kernels (explicit -mno-* flags win over -march=native in GCC and clang).
NO_AMX=""
if [ "$(uname -m)" = x86_64 ]; then NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
cmake -S "$SRC" -B "$OUT" -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" >/dev/null
cmake --build "$OUT" --config Release -j "$JOBS" --target llama-server ggml-rpc-server llama-quantize llama-bench
ln -sf ggml-rpc-server "$BIN/rpc-server"
echo "llama-server: $BIN/llama-server"
echo "rpc-server: $BIN/rpc-server"
echo "llama-quantize: $BIN/llama-quantize"
echo "llama-bench: $BIN/llama-bench"
