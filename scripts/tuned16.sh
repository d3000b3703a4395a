#!/usr/bin/env bash
# The tuned tables (docs/tuning.md), each resumable: a study whose state
# (bench/results/tuned16-<table>/: Optuna journal, tuning.json, finished runs' small files)
# exists goes on from it, on this machine or another, without repeating a finished trial; a
# finished one only has its report written again. After each table its report, with the
# one-draw table's conclusions checked (report-one-draw/, the table before final runs over
# data draws) and its between-method pairs.
#
#     bash scripts/tuned16.sh [TABLE ...]     # default: all six, in order
#
# Tables: feature-skew label-skew many-clients tap fedperfix feddpa, and the pFL baselines on
# the first two: label-skew-baselines feature-skew-baselines (FedDPA's other reports,
# TTP and against each of its methods: docs/tuning.md). Each
# has at least 16 trials per method in the widened spaces and a budget in client-rounds
# (--client-rounds): the one-draw table's (the largest spend of its methods' first 16 trials)
# plus 8 full trials for the widened spaces plus the selection's re-runs (top 3 x 2 seeds), so
# every method of a table spends the same compute, within one trial. Final runs at seeds 0-4,
# each on its own data draw, and on the glyph tables' transfer setups (configs/transfer/): a
# method whose choice or data draw changed refuses its old final runs, naming them; move them
# away (git rm in the state, rm in runs/) and run the table again. Run it from a
# clone pinned at one commit for the whole of a study (the trials of one study must come from
# one tree); commit the state directories as they grow (git add -f bench/results/tuned16-*).
# Measure nothing else on the machine meanwhile: the trials take both cores (--ray, 2 cells
# at once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
TABLES=("$@")
[ ${#TABLES[@]} -gt 0 ] || TABLES=(feature-skew label-skew many-clients tap fedperfix feddpa)

run() {  # run TABLE REFERENCE EARLIER-REPORT "FIRST SECOND ..." -- tune arguments
    local table="$1" reference="$2" earlier="$3" pairs=()
    local state="bench/results/tuned16-$table"
    if [ -d "$state/report" ] && [ ! -d "$state/report-one-draw" ]; then
        # the table before final runs over data draws: kept to check its conclusions
        mv "$state/report" "$state/report-one-draw"
    fi
    [ -d "$state/report-one-draw" ] && earlier="$state/report-one-draw"
    read -ra methods <<< "$4"
    for ((i = 0; i + 1 < ${#methods[@]}; i += 2)); do
        pairs+=(--pair "${methods[i]}" "${methods[i + 1]}")
    done
    shift 5
    "$PY" -m fedfm_flower.tune "$@" --trials 16 \
        --out "runs/tuned16-$table" --state "$state" --ray
    "$PY" -m fedfm_flower.report "runs/tuned16-$table" --out "$state/report" \
        --reference "$reference" --conclusions-of "$earlier" --conclusions-name "one draw" \
        "${pairs[@]}"
}

# The pFL baselines of the papers' tables, tuned on a glyph table's setup as its own study (from
# a newer tree than the table's: one study, one tree) at the table's client-round budget, with
# final runs on the same data draws; reported together with the table's methods, each against
# Local and against pFedSeq.
BASELINES="ditto pfedme fedala fedrod per-fedavg-lora apple pfedhn pfedla pefll perada"
baselines() {  # baselines TABLE-SETUP CLIENT-ROUNDS TRANSFER...
    local table="$1" budget="$2" pairs=()
    local state="bench/results/tuned16-$table-baselines"
    shift 2
    for method in $BASELINES; do pairs+=(--pair "$method" pfedseq); done
    # shellcheck disable=SC2086
    "$PY" -m fedfm_flower.tune --methods $BASELINES --setups "$table" --val-fraction 0.15 \
        --client-rounds "$budget" --transfer "$@" --trials 16 \
        --out "runs/tuned16-$table-baselines" --state "$state" --ray
    "$PY" -m fedfm_flower.report "runs/tuned16-$table" "runs/tuned16-$table-baselines" \
        --out "$state/report" --reference local "${pairs[@]}"
}

for table in "${TABLES[@]}"; do
    case "$table" in
        feature-skew)
            run glyphs-feature-skew local bench/results/tuned-glyphs/feature-skew \
                "pfedpg fedvpt pfedseq fedvpt pfedseq fedrep fedavg-ft fedvpt fedavg fedvpt fedrep fedvpt fedvpt-deep fedvpt fedavg-ft fedrep fedavg-ft pfedseq" -- \
                --methods local fedavg fedprox fedrep fedavg-ft fedvpt fedvpt-deep pfedseq pfedpg \
                --setups glyphs-feature-skew --val-fraction 0.15 --client-rounds 2796 \
                --transfer domain-dirichlet scarce ;;
        label-skew)
            run glyphs-label-skew local bench/results/tuned-glyphs/label-skew \
                "pfedseq fedrep pfedpg fedvpt pfedseq fedvpt pfedseq pfedpg fedrep fedvpt fedavg-ft fedrep fedavg-ft fedvpt fedavg-ft pfedseq fedvpt-deep fedvpt fedavg fedvpt" -- \
                --methods local fedavg fedprox fedrep fedavg-ft fedvpt fedvpt-deep pfedseq pfedpg \
                --setups glyphs-label-skew --val-fraction 0.15 --client-rounds 5080 \
                --transfer dirichlet-0.1 20-clients ;;
        many-clients)
            run glyphs-many-clients local bench/results/tuned-glyphs/many-clients \
                "fedavg-ft fedrep fedavg-ft fedvpt pfedpg fedvpt fedrep fedvpt pfedseq fedrep fedvpt-deep fedvpt pfedseq fedvpt pfedseq pfedpg" -- \
                --methods local fedavg fedprox fedrep fedavg-ft fedvpt fedvpt-deep pfedseq pfedpg \
                --setups glyphs-many-clients --val-fraction 0.15 --client-rounds 11910 \
                --transfer 50-clients 20-per-round ;;
        tap)
            run tap tap bench/results/tuned-tap \
                "fedavg-ft fedavg feddat fedavg feddat-ft fedavg-ft feddat-ft feddat" -- \
                --methods tap local fedavg fedavg-ft per-fedavg feddat feddat-ft \
                --setups multitask-cpu --client-rounds 5130 ;;
        fedperfix)
            run fedperfix local bench/results/tuned-fedperfix \
                "fedperfix fedavg fedperfix fedrep fedperfix apfl fedperfix fedbabu fedperfix per-fedavg" -- \
                --methods fedperfix fedavg local fedrep apfl fedbabu per-fedavg \
                --setups glyphs-whole-vit --val-fraction 0.15 --client-rounds 2964 \
                --transfer domain-dirichlet scarce ;;
        feddpa)  # Centralized (one pooled client, 8 rounds a trial) first, with no client-round budget
            "$PY" -m fedfm_flower.tune --methods centralized --setups instructions-8-tasks \
                --trials 16 --out runs/tuned16-feddpa --state bench/results/tuned16-feddpa --ray
            run feddpa fedavg-ft bench/results/tuned-feddpa \
                "feddpa-t feddpa-f feddpa-t:fixed feddpa-t fedavg local" -- \
                --methods feddpa-t fedavg fedavg-ft local feddpa-f feddpa-t:fixed feddpa-f:fixed \
                --setups instructions-8-tasks --client-rounds 2144 ;;
        label-skew-baselines)
            baselines glyphs-label-skew 5080 dirichlet-0.1 20-clients ;;
        feature-skew-baselines)
            baselines glyphs-feature-skew 2796 domain-dirichlet scarce ;;
        *)
            echo "error: unknown table '$table' (feature-skew label-skew many-clients tap fedperfix feddpa label-skew-baselines feature-skew-baselines)" >&2
            exit 2 ;;
    esac
done
