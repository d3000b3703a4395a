#!/usr/bin/env bash
# Everything a lent GPU machine should measure, in one command and one JSON, inside 8 minutes:
# the main job (pFedSeq on the offline default), the overhead section of `bench.suite --gpu`
# (timm ViT-S/16 and ViT-B/16 at 224 px, GPU shares 1 and 0.25, 10 and 100 clients, against
# the bare loop) and pFedSeq's CUDA server-step grid (D = 1e5 and 1e6, N = 10 and 100, L = 5
# and 20).
#
#     bash scripts/gpu_wheels.sh .whl                 # here, with a registry (about 60 MB)
#     OUT=$OUT bash scripts/gpu_check.sh              # there (the device tool: carry .whl)
#
# On an image with torch but without Flower, Ray or datasets, the wheels in $WHEELS (default
# .whl) are installed first, then this project without its dependencies. Each part runs under
# its own time limit, so a part that hangs costs its limit and no more; a part's exit status,
# seconds and log are kept either way. Everything lands under $OUT (default
# bench/results/gpu-check): gpu-check.json (the parts, the machine, the main job's summary,
# the suite's and the grid's results), every part's log and raw results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="$(mkdir -p "${OUT:-bench/results/gpu-check}" && cd "${OUT:-bench/results/gpu-check}" && pwd)"
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
: > "$OUT/parts.jsonl"

# part NAME LIMIT COMMAND...: run under LIMIT seconds; one line of parts.jsonl
part() {
    local name="$1" limit="$2" started ended status
    shift 2
    started=$(date +%s.%N)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    status=$?
    ended=$(date +%s.%N)
    "$PY" -c 'import json, sys; print(json.dumps({"part": sys.argv[1], "exit": int(sys.argv[2]),
        "timed-out": sys.argv[2] in ("124", "137"), "limit-s": float(sys.argv[3]),
        "seconds": round(float(sys.argv[5]) - float(sys.argv[4]), 1)}))' \
        "$name" "$status" "$limit" "$started" "$ended" >> "$OUT/parts.jsonl"
}

if [ -d "$WHEELS" ] && ! "$PY" -c "import flwr, ray, datasets" 2> /dev/null; then
    part install 120 "$PY" -m pip install --no-index --no-deps "$WHEELS"/*.whl
fi
if ! "$PY" -c "import fedfm_flower.config.experiment" 2> /dev/null; then
    part install-project 60 "$PY" -m pip install --no-deps --no-build-isolation -e .
fi
# pip --target or a user site puts Flower's commands elsewhere: put them on PATH
export PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$HOME/.local/bin:$PATH"
{
    nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv,noheader
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/machine.txt" 2>&1

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 FLWR_DISABLE_UPDATE_CHECK=1 RAY_DEDUP_LOGS=0
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_HOME="$OUT/flwr-home"
part main-job 120 "$PY" -m fedfm_flower.simulation --num-supernodes 10 \
    -- -c "output-dir='$OUT/runs' run-name='main-job'"
part overhead 240 "$PY" -m bench.suite --gpu --sections overhead
cp bench/results/suite/results-gpu.json bench/results/suite/tables-gpu.md "$OUT/" 2> /dev/null
part pfedseq-grid 110 "$PY" -m bench.pfedseq_server_step --device cuda --d 100000 1000000 \
    --n 10 100 --l 5 20 --paths batched fused --backend torch --repeats 3 --timeout-per-cell 25 \
    --out "$OUT/pfedseq"

"$PY" - "$OUT" <<'PY'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])


def read(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


summaries = sorted((out / "runs").glob("main-job*/summary.json"))
report = {
    "machine": (out / "machine.txt").read_text().splitlines() if (out / "machine.txt").exists() else [],
    "parts": [json.loads(line) for line in (out / "parts.jsonl").read_text().splitlines() if line],
    "main-job": read(summaries[-1]) if summaries else None,
    "overhead": read(out / "results-gpu.json"),
    "pfedseq-grid": read(out / "pfedseq" / "results-cuda.json"),
}
(out / "gpu-check.json").write_text(json.dumps(report, indent=1))
for item in report["parts"]:
    print(f"{item['part']}: exit {item['exit']}, {item['seconds']} s of {item['limit-s']:g}")
print(f"wrote {out / 'gpu-check.json'}")
PY
