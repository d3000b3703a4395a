#!/usr/bin/env bash
# Real deployment on this machine over 127.0.0.1: one SuperLink, N SuperNodes, one `flwr run`,
# then everything is stopped. Arguments go to scripts/deploy_local.py, the command of the
# library fedfm_flower.deploy (see --help and docs/deployment.md), e.g.:
#   scripts/deploy_local.sh --num-supernodes 3 --run-config "method='fedavg' num-server-rounds=5"
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
exec .venv/bin/python scripts/deploy_local.py "$@"
