#!/usr/bin/env bash
# Create .venv (if missing) and install fedfm-flower with its dev extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch/torchvision are pinned to a matching pair (a mismatched torchvision fails to import).
.venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install --quiet -e ".[dev]"
echo "fedfm-flower installed in $(pwd)/.venv"
