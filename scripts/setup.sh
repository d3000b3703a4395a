#!/usr/bin/env bash
# Create .venv (if missing) and install fedfm-flower with its dev extras. Idempotent.
# PYTHON selects the interpreter (default python3); it must satisfy requires-python in
# pyproject.toml (flwr 1.42 and flwr-datasets 0.6 need Python 3.11 or newer).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
REQUIRED="$(sed -n 's/^requires-python = ">=\([0-9.]*\)".*/\1/p' pyproject.toml)"

check_python() {  # $1: interpreter, $2: what to do about it
    local version
    if ! version="$("$1" -c 'import platform; print(platform.python_version())' 2>/dev/null)"; then
        echo "error: cannot run Python interpreter '$1'; $2" >&2
        exit 1
    fi
    if ! "$1" -c "import sys; sys.exit(sys.version_info[:2] < tuple(map(int, '$REQUIRED'.split('.'))))"; then
        echo "error: fedfm-flower needs Python >= $REQUIRED (flwr 1.42 and flwr-datasets 0.6 require it), but '$1' is Python $version; $2" >&2
        exit 1
    fi
}

if [ ! -x .venv/bin/python ]; then
    check_python "$PYTHON" "set PYTHON=/path/to/python$REQUIRED (or newer) and run this again"
    "$PYTHON" -m venv .venv
else
    check_python .venv/bin/python "remove .venv and run this again with PYTHON=/path/to/python$REQUIRED (or newer)"
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch/torchvision are pinned to a matching pair (a mismatched torchvision fails to import).
.venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install --quiet -e ".[dev]"
echo "fedfm-flower installed in $(pwd)/.venv"
