# Source this file for the recommended environment of `flwr run` in this project:
#   source scripts/env.sh && flwr run . --stream
# - FLWR_HOME inside the project, so the local SuperLink, its logs and connections are ours;
# - no runtime dependency installation (it would download torch again with uv);
# - Hugging Face libraries offline (everything here works without the Hub);
# - no usage reports from Flower (telemetry) or Ray (usage stats) unless already turned on.
_FEDFM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export FLWR_HOME="${FLWR_HOME:-$_FEDFM_ROOT/.flwr}"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_DISABLE_UPDATE_CHECK=1
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
export FLWR_TELEMETRY_ENABLED="${FLWR_TELEMETRY_ENABLED:-0}"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
export RAY_DEDUP_LOGS=0
export PATH="$_FEDFM_ROOT/.venv/bin:$PATH"
unset _FEDFM_ROOT
