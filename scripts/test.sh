#!/usr/bin/env bash
# Set everything up and run the whole test suite (offline; CPU is enough).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
