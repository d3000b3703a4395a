#!/usr/bin/env bash
# The 16-trial tuned tables (docs/tuning.md), each resumable: a study whose state
# (bench/results/tuned16-<table>/: Optuna journal, tuning.json, finished runs' small files)
# exists goes on from it, on this machine or another, without repeating a finished trial; a
# finished one only has its report written again. After each table its report, with the
# 4-trial table's conclusions checked and its between-method pairs.
#
#     bash scripts/tuned16.sh [TABLE ...]     # default: all four, in order
#
# Tables: label-skew many-clients tap fedperfix. Run it from a clone pinned at one commit for
# the whole of a study (the trials of one study must come from one tree); commit the state
# directories as they grow (git add -f bench/results/tuned16-*). Measure nothing else on the
# machine meanwhile: the trials take both cores (--ray, 2 cells at once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
TABLES=("$@")
[ ${#TABLES[@]} -gt 0 ] || TABLES=(label-skew many-clients tap fedperfix)

run() {  # run TABLE REFERENCE EARLIER-REPORT "FIRST SECOND ..." -- tune arguments
    local table="$1" reference="$2" earlier="$3" pairs=()
    read -ra methods <<< "$4"
    for ((i = 0; i + 1 < ${#methods[@]}; i += 2)); do
        pairs+=(--pair "${methods[i]}" "${methods[i + 1]}")
    done
    shift 5
    "$PY" -m fedfm_flower.tune "$@" --trials 16 --seeds 0 1 2 \
        --out "runs/tuned16-$table" --state "bench/results/tuned16-$table" --ray
    "$PY" -m fedfm_flower.report "runs/tuned16-$table" --out "bench/results/tuned16-$table/report" \
        --reference "$reference" --conclusions-of "$earlier" --conclusions-name "4 trials" \
        "${pairs[@]}"
}

for table in "${TABLES[@]}"; do
    case "$table" in
        label-skew)
            run glyphs-label-skew local bench/results/tuned-glyphs/label-skew \
                "pfedseq fedrep pfedpg fedvpt pfedseq fedvpt pfedseq pfedpg fedrep fedvpt fedavg-ft fedrep fedavg-ft fedvpt fedavg-ft pfedseq fedvpt-deep fedvpt fedavg fedvpt" -- \
                --methods local fedavg fedprox fedrep fedavg-ft fedvpt fedvpt-deep pfedseq pfedpg \
                --setups glyphs-label-skew --val-fraction 0.15 ;;
        many-clients)
            run glyphs-many-clients local bench/results/tuned-glyphs/many-clients \
                "fedavg-ft fedrep fedavg-ft fedvpt pfedpg fedvpt fedrep fedvpt pfedseq fedrep" -- \
                --methods local fedavg fedprox fedrep fedavg-ft fedvpt fedvpt-deep pfedseq pfedpg \
                --setups glyphs-many-clients --val-fraction 0.15 ;;
        tap)
            run tap tap bench/results/tuned-tap \
                "fedavg-ft fedavg feddat fedavg feddat-ft fedavg-ft feddat-ft feddat" -- \
                --methods tap local fedavg fedavg-ft per-fedavg feddat feddat-ft \
                --setups multitask-cpu ;;
        fedperfix)
            run fedperfix local bench/results/tuned-fedperfix \
                "fedperfix fedavg fedperfix fedrep fedperfix apfl fedperfix fedbabu fedperfix per-fedavg" -- \
                --methods fedperfix fedavg local fedrep apfl fedbabu per-fedavg \
                --setups glyphs-whole-vit --val-fraction 0.15 ;;
        *)
            echo "error: unknown table '$table' (label-skew many-clients tap fedperfix)" >&2
            exit 2 ;;
    esac
done
