#!/usr/bin/env bash
# Set everything up and run the main job (the embedded offline default) in Flower simulation.
# Extra arguments go to `flwr run`, e.g.: scripts/main.sh -c configs/fedavg/digits-label-skew.toml
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
NUM_SUPERNODES="${NUM_SUPERNODES:-10}"
.venv/bin/python -m fedfm_flower.simulation --num-supernodes "$NUM_SUPERNODES" -- "$@"
