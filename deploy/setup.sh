#!/usr/bin/env bash
# Create .venv and install fleet with the compiler extra: what the demo needs (deploy/demo.sh), no torch.
# `setup.sh --test` (deploy/test.sh) adds the test tools (CPU-only torch and transformers: the tests' reference,
# fleet itself needs neither), mkdocs for the docs site's test, and the apt packages the tests use (chromium,
# node, iproute2).
# Idempotent: a second run with an unchanged pyproject.toml (and no new mode) returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MODE=demo
if [ "${1:-}" = "--test" ]; then MODE=test; elif [ -n "${1:-}" ]; then
  echo "usage: deploy/setup.sh [--test]" >&2; exit 2
fi
STAMP=.venv/.fleet-installed
WANT=$(sha256sum pyproject.toml | cut -c1-16)
# a test install holds the demo's too
if [ -f "$STAMP" ] && { [ "$(cat "$STAMP")" = "$WANT test" ] || [ "$(cat "$STAMP")" = "$WANT $MODE" ]; }; then exit 0; fi
if [ "$MODE" = test ]; then
# The chat page's test drives Debian's chromium through its chromedriver (apt packages, not a browser download).
# Installed only when missing; where apt-get is not ours to use, the test skips and says why (CI fails instead).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-liberation \
        >/dev/null; } || echo "setup: apt-get could not install chromium: the chat page's browser test will skip" >&2
  else
    echo "setup: chromium/chromedriver missing and apt-get unavailable (or not root): install Debian's chromium" \
         "and chromium-driver, or the chat page's browser test skips" >&2
  fi
fi
# The chat page's modules are tested under node's own test runner (tests/unit/test_page_js.py; node 18 or newer,
# the first with `node --test`): Debian's nodejs, installed only when node is missing. Not pinned to a version
# (each release has its own: bookworm 18.20, trixie 20.19), only checked for 18 or newer; where apt-get is not
# ours to use or the node found is older, that test skips and says why (CI fails instead).
if ! command -v node >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs \
        >/dev/null; } || echo "setup: apt-get could not install nodejs: the chat page's node tests will skip" >&2
  else
    echo "setup: node missing and apt-get unavailable (or not root): install nodejs 18 or newer, or the chat" \
         "page's node tests skip" >&2
  fi
fi
if command -v node >/dev/null && [ "$(node -p 'process.versions.node.split(".")[0]')" -lt 18 ]; then
  echo "setup: node $(node --version) is older than 18 (no 'node --test'): the chat page's node tests skip" >&2
fi
# The LAN tests (tests/lan) make network namespaces with iproute2's `ip` (and `bridge`); they skip, saying why,
# where it is missing or namespaces are not allowed (not root, a container without CAP_NET_ADMIN).
if ! command -v ip >/dev/null || ! command -v bridge >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 \
        >/dev/null; } || echo "setup: apt-get could not install iproute2: the LAN tests will skip" >&2
  else
    echo "setup: iproute2 missing and apt-get unavailable (or not root): the LAN tests skip" >&2
  fi
fi
fi  # the test mode's apt packages
# fleet's kernels (kernels/, C++17) are built by `pip install` (setup.py; cmake itself comes from PyPI): a C++
# compiler and make, installed here where missing.
if ! command -v c++ >/dev/null || ! command -v make >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ make \
        >/dev/null; } || { echo "setup: apt-get could not install g++ and make, which fleet's kernels need" >&2; exit 1; }
  else
    echo "setup: fleet's kernels need a C++ compiler (g++ 9 or newer) and make: install them (Debian/Ubuntu:" \
         "apt-get install g++ make) and run this again" >&2
    exit 1
  fi
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${PIP[@]}" --upgrade pip
if [ "$MODE" = test ]; then
  # torch must be the CPU build. On machines whose pip is pointed at a local CPU wheel this just works;
  # elsewhere set FLEET_TORCH_INDEX=https://download.pytorch.org/whl/cpu (PyPI's default Linux wheel is a
  # multi-GB CUDA build).
  "${PIP[@]}" torch==2.13.0 ${FLEET_TORCH_INDEX:+--index-url "$FLEET_TORCH_INDEX"}
  "${PIP[@]}" -e ".[compile,dev,docs]"  # docs: the suite builds the documentation site (mkdocs)
else
  "${PIP[@]}" -e ".[compile]"
fi
echo "$WANT $MODE" > "$STAMP"
