#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: fast unit tests, then integration tests that build
# the real demo model and start real workers and coordinators on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh --test
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
