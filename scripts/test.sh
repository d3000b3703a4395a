#!/usr/bin/env bash
# Set everything up and run the whole test suite (offline; CPU is enough).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
# Two workers (FEDFM_TEST_WORKERS, 0 for one process); the tests that start real processes run
# one at a time on one of them (tests/conftest.py, PROCESS_MODULES).
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${FEDFM_TEST_WORKERS:-2}" "$@"
