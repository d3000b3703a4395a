"""The mamba-ssm / causal-conv1d CUDA kernels against the PyTorch path of pFedSeq's learner.

    python -m bench.pfedseq_kernels                    # needs CUDA, mamba-ssm and causal-conv1d
    python -m bench.pfedseq_kernels --rows 16384 --n 10 --l 5 20 --repeats 10

For every N (clients) in ``--n`` and L (window) in ``--l``, on random float32 inputs shaped like
pFedSeq's (the batch is ``--rows`` rows of the adapter's D), two comparisons:

* ``scan``: ``selective_scan`` alone, ``backend="cuda"`` against ``backend="torch"``, with
  u, delta, z of shape (rows, expand * N, L), B and C of shape (rows, state-dim, L), A of shape
  (expand * N, state-dim) (S4D-real), D, delta_bias (log-uniform step sizes) and
  ``delta_softplus=True``, as ``MambaMixer`` calls it;
* ``learner``: a whole ``SequenceLearner`` (mamba kind, cross-client, ``--num-layers`` blocks),
  built twice with identical weights, one with backend ``cuda`` (both kernels), one ``torch``, on a
  (rows, L, N) window. Its out-projections are zero at initialisation (the calibration starts at
  0), which would make the output and most gradients 0; they are re-drawn with ``nn.Linear``'s
  default initialisation before the copy, so every parameter gets a gradient.

Each path runs once with gradients on the loss ``sum(out * g)`` (g random, like pFedSeq's
surrogate): the outputs, the gradients w.r.t. the inputs and w.r.t. the parameters are compared
as max abs difference, relative max (max abs difference / max abs of the torch path's tensor)
and relative L2 (||kernel - torch|| / ||torch||). Then each path is timed (torch.cuda.synchronize
around each call; median of ``--repeats`` after one warm-up): forward alone (no grad, as the
inference) and forward + backward (as the learner update), with the peak CUDA memory of the
latter. When a cell runs out of GPU memory its rows are halved (down to ``--min-rows``) and the
cell is rerun; the rows used are recorded.

Writes ``results.json`` (every number, the settings and the machine) and ``table.md`` under
``--out`` (default bench/results/pfedseq_kernels/), replacing them; with ``--merge`` the cells
already there that this run does not measure are kept. TF32 is switched off (cuBLAS and cuDNN),
so both paths compute in true float32. On a machine without a CUDA device or without
the kernels it prints one line saying what is missing and exits with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.pfedseq_server_step import count, load_earlier, machine_info, merged
from fedfm_flower.records.durable import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "pfedseq_kernels"
MIB = float(1 << 20)
DT_MIN, DT_MAX = 1e-3, 1e-1
KEY = ("part", "n", "l")
DEVICE = "cuda"  # where every tensor lives (a module constant, so a test can swap it)


def missing_requirements() -> list[str]:
    """What this benchmark needs and this machine lacks (empty when it can run)."""
    missing = []
    if not torch.cuda.is_available():
        missing.append(f"a CUDA device (torch {torch.__version__} sees none)")
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn  # noqa: F401
    except Exception as error:  # noqa: BLE001 - missing, or built for another torch/CUDA
        missing.append(f"mamba-ssm ({type(error).__name__}: {error})")
    try:
        from causal_conv1d import causal_conv1d_fn  # noqa: F401
    except Exception as error:  # noqa: BLE001
        missing.append(f"causal-conv1d ({type(error).__name__}: {error})")
    return missing


# --------------------------------------------------------------------------- comparison
def compare(kernel: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Max abs, relative max and relative L2 difference of ``kernel`` against ``reference``."""
    kernel = kernel.to(reference.device, torch.float64)
    reference = reference.to(torch.float64)
    diff = kernel - reference
    max_abs = float(diff.abs().max())
    ref_max = float(reference.abs().max())
    ref_norm = float(reference.norm())
    return {
        "max_abs": max_abs,
        "ref_max_abs": ref_max,
        "rel_max": max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else math.inf),
        "rel_l2": float(diff.norm()) / ref_norm if ref_norm > 0 else 0.0,
        "finite": bool(torch.isfinite(kernel).all()),
    }


def outputs_and_grads(
    forward: Callable[[], torch.Tensor], leaves: dict[str, torch.Tensor], weight: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One forward + backward of sum(out * weight); the output and each leaf's grad, on CPU."""
    for leaf in leaves.values():
        leaf.grad = None
    out = forward()
    (out * weight).sum().backward()
    torch.cuda.synchronize()
    result = {"output": out.detach().cpu()}
    for name, leaf in leaves.items():
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        result[f"grad.{name}"] = grad.detach().cpu()
        leaf.grad = None
    return result


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``call`` (synchronised) over ``repeats`` runs after one warm-up."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def time_path(
    forward: Callable[[], torch.Tensor],
    leaves: dict[str, torch.Tensor],
    weight: torch.Tensor,
    repeats: int,
) -> dict[str, float]:
    """Forward and forward + backward times (ms) and the latter's peak CUDA memory (MiB)."""

    def forward_only() -> None:
        with torch.no_grad():
            forward()

    def forward_backward() -> None:
        for leaf in leaves.values():
            leaf.grad = None
        (forward() * weight).sum().backward()

    forward_ms = 1e3 * median_seconds(forward_only, repeats)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    backward_ms = 1e3 * median_seconds(forward_backward, repeats)
    peak = (torch.cuda.max_memory_allocated() - base) / MIB
    for leaf in leaves.values():
        leaf.grad = None
    return {"forward_ms": forward_ms, "forward_backward_ms": backward_ms, "peak_mib": peak}


def run_pair(
    paths: dict[str, tuple[Callable[[], torch.Tensor], dict[str, torch.Tensor]]],
    weight: torch.Tensor,
    repeats: int,
) -> dict[str, Any]:
    """Compare the ``cuda`` path with the ``torch`` path and time both."""
    results = {name: outputs_and_grads(fn, leaves, weight) for name, (fn, leaves) in paths.items()}
    kernel, reference = results["cuda"], results["torch"]
    differences = {key: compare(kernel[key], reference[key].to(DEVICE)) for key in reference}
    del results, kernel, reference
    gc.collect()
    torch.cuda.empty_cache()
    timings = {name: time_path(fn, leaves, weight, repeats) for name, (fn, leaves) in paths.items()}
    return {"differences": differences, "timings": timings}


# --------------------------------------------------------------------------- the two parts
def scan_cell(
    rows: int, clients: int, steps: int, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """``selective_scan`` with the kernel against the PyTorch scan, on pFedSeq-shaped inputs."""
    from fedfm_flower.learners.selective_scan import selective_scan

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    inner, state = args.expand * clients, args.state_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=DEVICE)

    dt = torch.exp(
        torch.rand(inner, generator=g, device=DEVICE) * (math.log(DT_MAX) - math.log(DT_MIN))
        + math.log(DT_MIN)
    )
    inputs = {
        "u": randn(rows, inner, steps),
        "delta": 0.5 * randn(rows, inner, steps),
        "A": -torch.arange(1, state + 1, dtype=torch.float32, device=DEVICE).repeat(inner, 1),
        "B": randn(rows, state, steps),
        "C": randn(rows, state, steps),
        "D": 1.0 + 0.1 * randn(inner),
        "z": randn(rows, inner, steps),
        "delta_bias": dt + torch.log(-torch.expm1(-dt)),
    }
    weight = randn(rows, inner, steps)
    paths = {}
    for backend in ("cuda", "torch"):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}

        def forward(leaves: dict[str, torch.Tensor] = leaves, backend: str = backend) -> Any:
            return selective_scan(**leaves, delta_softplus=True, backend=backend)

        paths[backend] = (forward, leaves)
    del inputs
    return run_pair(paths, weight, args.repeats)


def learner_cell(
    rows: int, clients: int, steps: int, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """A whole mamba ``SequenceLearner`` on backend cuda against the same one on torch."""
    from fedfm_flower.learners.mamba import MambaMixer
    from fedfm_flower.learners.sequence import LearnerSpec, SequenceLearner

    spec = LearnerSpec(
        kind="mamba",
        num_layers=args.num_layers,
        state_dim=args.state_dim,
        expand=args.expand,
        conv_kernel=args.conv_kernel,
        seq_len=steps,
        backend="cuda",
    )
    torch.manual_seed(seed)
    kernel_model = SequenceLearner(spec, clients)
    for module in kernel_model.modules():
        if isinstance(module, MambaMixer):
            module.out_proj.reset_parameters()  # non-zero, so that every parameter gets a grad
    torch_model = SequenceLearner(dataclasses.replace(spec, backend="torch"), clients)
    torch_model.load_state_dict(kernel_model.state_dict())
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    window = torch.randn(rows, steps, clients, generator=g, device=DEVICE)
    weight = torch.randn(rows, clients, generator=g, device=DEVICE)
    paths = {}
    for backend, model in (("cuda", kernel_model), ("torch", torch_model)):
        model.to(DEVICE)
        leaves = {"window": window.clone().requires_grad_()}
        leaves.update(dict(model.named_parameters()))

        def forward(model: nn.Module = model, x: torch.Tensor = leaves["window"]) -> Any:
            return model(x)

        paths[backend] = (forward, leaves)
    return run_pair(paths, weight, args.repeats)


def run_with_halving(
    part: str, clients: int, steps: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One cell at the largest rows (``--rows``, halved on OOM) that fit; its record."""
    cell = scan_cell if part == "scan" else learner_cell
    rows = args.rows
    while True:  # the first try runs whatever --min-rows says
        try:
            started = time.perf_counter()
            record = cell(rows, clients, steps, args, args.seed)
            record.update(
                part=part,
                n=clients,
                l=steps,
                rows=rows,
                status="ok",
                wall_seconds=time.perf_counter() - started,
            )
            return record
        except torch.cuda.OutOfMemoryError:
            pass
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  {part} N={clients} L={steps}: out of memory at {rows} rows", flush=True)
        if rows // 2 < args.min_rows:
            break
        rows //= 2
    return {"part": part, "n": clients, "l": steps, "rows": rows, "status": "oom"}


# --------------------------------------------------------------------------- output
def worst(differences: dict[str, dict[str, float]], prefix: str) -> tuple[float, str]:
    """The largest relative max difference among keys starting with ``prefix``, and its key."""
    items = [(d["rel_max"], k) for k, d in differences.items() if k.startswith(prefix)]
    return max(items) if items else (0.0, "-")


def table(records: list[dict[str, Any]]) -> str:
    """The markdown table of all cells."""
    header = [
        "part",
        "N",
        "L",
        "rows",
        "out max abs",
        "out rel max",
        "worst grad rel max",
        "fwd ms cuda",
        "fwd ms torch",
        "fwd speedup",
        "fwd+bwd ms cuda",
        "fwd+bwd ms torch",
        "fwd+bwd speedup",
        "peak MiB cuda",
        "peak MiB torch",
    ]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['part']} | {r['n']} | {r['l']} | {r['status']} |")
            continue
        diff, cuda, ref = r["differences"], r["timings"]["cuda"], r["timings"]["torch"]
        grad_rel, grad_key = worst(diff, "grad.")
        cells = [
            r["part"],
            str(r["n"]),
            str(r["l"]),
            str(r["rows"]),
            f"{diff['output']['max_abs']:.2e}",
            f"{diff['output']['rel_max']:.2e}",
            f"{grad_rel:.2e} ({grad_key[len('grad.') :]})",
            f"{cuda['forward_ms']:.3g}",
            f"{ref['forward_ms']:.3g}",
            f"{ref['forward_ms'] / cuda['forward_ms']:.3g}x",
            f"{cuda['forward_backward_ms']:.3g}",
            f"{ref['forward_backward_ms']:.3g}",
            f"{ref['forward_backward_ms'] / cuda['forward_backward_ms']:.3g}x",
            f"{cuda['peak_mib']:.4g}",
            f"{ref['peak_mib']:.4g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=count, default=65536, help="batch: rows of D")
    parser.add_argument("--min-rows", type=count, default=1024, help="stop halving below")
    parser.add_argument("--n", type=count, nargs="+", default=[10, 100], help="clients")
    parser.add_argument("--l", type=count, nargs="+", default=[5, 20], help="window lengths")
    parser.add_argument(
        "--parts", nargs="+", choices=["scan", "learner"], default=["scan", "learner"]
    )
    parser.add_argument("--num-layers", type=count, default=2)
    parser.add_argument("--state-dim", type=count, default=16)
    parser.add_argument("--expand", type=count, default=2)
    parser.add_argument("--conv-kernel", type=count, default=4)
    parser.add_argument("--repeats", type=count, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the cells already in --out that this run does not measure again",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Check the machine, run every cell, write results.json and table.md, print the table."""
    args = parse_args(argv)
    missing = missing_requirements()
    if missing:
        print("pfedseq_kernels: cannot run, missing " + "; ".join(missing), file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 comparisons, not TF32
    torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    machine = machine_info("cuda")
    must_match = ("num_layers", "state_dim", "expand", "conv_kernel")
    earlier, machines = load_earlier(out / "results.json", args.merge, settings, must_match)
    records: list[dict[str, Any]] = []
    for part in args.parts:
        for clients in args.n:
            for steps in args.l:
                record = run_with_halving(part, clients, steps, args)
                records.append(record)
                print(f"{part} N={clients} L={steps}: {record['status']}", flush=True)
                cells = merged(earlier, records, KEY)
                payload = {"settings": settings, "machine": machine, "cells": cells}
                if machines:
                    payload["earlier_machines"] = machines
                # Atomic, not durable: a kill mid-write must not lose the earlier cells.
                text = json.dumps(payload, indent=2) + "\n"
                atomic_write_text(out / "results.json", text, durable=False)
                atomic_write_text(out / "table.md", table(cells), durable=False)
    print()
    print(table(merged(earlier, records, KEY)), end="")
    print(f"\nwrote {out / 'results.json'} and {out / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
