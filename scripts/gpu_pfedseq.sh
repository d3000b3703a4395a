#!/usr/bin/env bash
# pFedSeq's server step on a GPU machine: the CUDA grid (D = 1e5 and 1e6, N = 10 and 100,
# L = 5 and 20), the eager scan against the fused Triton scan, and the mamba-ssm kernels when
# installed. Needs torch and Triton (the bench imports no Flower, Ray or datasets), so no
# wheels travel.
#
#     OUT=/path/to/out bash scripts/gpu_pfedseq.sh      # the device tool: OUT=$OUT, one call
#
# Every figure lands under $OUT (default bench/results/pfedseq_server_step/gpu); the grid stops
# at 420 s and each cell at 60 s, so the whole script stays under 8 minutes with start-up.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/pfedseq_server_step/gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c "import torch; print(torch.__version__, torch.version.cuda)" >> "$OUT/gpu.txt"
timeout 420 "$PY" -m bench.pfedseq_server_step --device cuda --d 100000 1000000 --n 10 100 \
    --l 5 20 --paths batched fused --backend torch --repeats 3 --timeout-per-cell 60 --out "$OUT" \
    > "$OUT/grid.log" 2>&1
echo "grid exit $?" >> "$OUT/grid.log"
if "$PY" -c "import mamba_ssm" 2> /dev/null; then
    timeout 90 "$PY" -m bench.pfedseq_server_step --device cuda --d 1000000 --n 10 --l 5 \
        --paths batched --backend cuda --repeats 3 --out "$OUT/mamba-ssm" > "$OUT/mamba.log" 2>&1
else
    echo "mamba-ssm not importable: no kernel comparison" > "$OUT/mamba.log"
fi
cat "$OUT"/table-*.md 2> /dev/null
