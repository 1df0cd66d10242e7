#!/usr/bin/env bash
# Set up (if needed) and run the demo: fetch SmolLM2-135M-Instruct, compile 2 shards, start 2 workers
# and a coordinator (found by zeroconf), ask one question, print the answer and tokens/s, stop everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
exec .venv/bin/python deploy/demo.py "$@"
