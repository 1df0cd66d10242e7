#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: fast unit tests, then integration tests that build
# the real demo model and start real workers and coordinators on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh --test
# The suite writes up to ~7 GiB at once (the demo's builds under models/, pytest's temporary builds in $TMPDIR).
# On a fuller disk every later test errors without saying why, until CI's time runs out: say it at once.
NEED_GIB=8
for dir in "${FLEET_TEST_MODELS:-.}" "${TMPDIR:-/tmp}"; do
  mkdir -p "$dir"
  free=$(df -Pk "$dir" | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "$free" -lt "$NEED_GIB" ]; then
    echo "test: $free GiB free on the disk of $dir; the suite needs $NEED_GIB GiB there: free some space" >&2
    exit 1
  fi
done
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
