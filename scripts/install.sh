#!/usr/bin/env bash
# Everything a fresh machine needs to run the main job and the tests, at the
# exact versions of constraints.txt (refresh it with scripts/lock.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

# The CPU build of torch first (torch==2.13.0 lies on this machine's disk), so nothing
# pulls a multi-GB CUDA build; and the build backend, pinned too: pip's isolated build
# environment would ignore the constraints and take whatever setuptools is newest.
python -m pip install --quiet -c constraints.txt torch setuptools
python -m pip install --quiet --no-build-isolation -c constraints.txt -e ".[test]"
# and fail if anything raypipe[test] needs is unpinned or at another version (a dependency
# added to pyproject.toml without re-locking)
python scripts/check_pins.py

# Prometheus (Debian's package) for the metrics integration test
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "note: no prometheus binary; tests/observability/test_prometheus.py's integration test will skip (apt-get install prometheus)"
  fi
fi
