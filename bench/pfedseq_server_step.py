"""Cost of one pFedSeq server step: time and peak working memory over adapter size, clients, L.

    python -m bench.pfedseq_server_step                      # full grid, CPU or CUDA (auto)
    python -m bench.pfedseq_server_step --device cpu --d 10000 100000 --n 10 --l 5 20
    python -m bench.pfedseq_server_step --device cuda --learner mamba --backend cuda
    python -m bench.pfedseq_server_step --quick --device cpu --threads 1 --round-rest 0.69

One step is ``PFedSeqServer.step()`` once the history holds L rounds and the warm-up is over:
the learner update (eq. 5: forward + backward over the window in chunks of D rows, one Adam step)
plus inference (calibrations for every client), plus the cheap bookkeeping around them (eq. 1,
history update). The grid is adapter size D x clients N x window L (default D in {1e4, 1e5, 1e6},
N in {10, 100}, L in {5, 20}). The adapter is ``--layers`` layers of D / layers parameters each
(tensors ``blocks.<k>.lora.weight``; default one layer, so one learner and the numbers are per
layer).

The server paths are measured in the same run (``--paths``, default loop and batched), cell by
cell, each in its own child process: ``loop`` is the per-layer reference (one learner and one
chunk at a time, ``PFedSeqServer(batch_layers=False)``), ``batched`` the default (all layers'
learners in one batched call per chunk, with ``--backend``), ``compiled`` the batched path with
the scan's steps compiled (``pfedseq-scan-backend = compiled``; its child's construction
compiles them, so the timed steps do not), ``fused`` the batched path with the fused C scan
(``pfedseq-scan-backend = fused``; built, or loaded from its cache, when the server is
built). The table puts the first two paths of ``--paths`` side by side with their ratio and
the learner calls per pass (chunks over all layers). ``--round-rest S`` adds each path's share
of a round, step / (S + step), where S is the rest of a round (a measured round minus its
server step; the benchmark runs no clients, so it has to be given).

``--quick`` measures the offline setups' shape instead of the grid: 4 layers (tiny-vit, LoRA on
qkv), the points of the suite's server-cost section (D = 4,096 and 16,384; N = 10 and 100;
L = 5 and 10; ``bench.suite``), written to ``results-<device>-quick.json`` and
``table-<device>-quick.md``.

Every cell runs in its own child process (``--cell D N L``), so that one cell's allocations do
not inflate the next one's memory and a cell over ``--timeout-per-cell`` can be killed. The child:

1. builds the server (``seq_len = L``, ``warmup_rounds = L``) and fills its history directly:
   ``server.history`` gets L random (D, N) float32 tensors (normal, std 1e-3, the size of real
   adapter updates), ``server.masks`` L all-ones masks, and ``server.round = L``, so the next
   ``step()`` is round L + 1: past the warm-up, with a full window of L rounds. This skips L
   real steps, which would cost as much as what is measured;
2. draws random updates for all N clients (std 1e-3) and calls ``step()`` once: this first call
   measures the peak working memory (the peak RSS increase over the RSS just before the call, the
   kernel's high-water mark being reset through ``/proc/self/clear_refs``; on CUDA also
   ``torch.cuda.max_memory_allocated`` over the allocation before the call) and is a warm-up;
3. times ``--repeats`` further calls (each a steady-state step: the history stays at L rounds)
   and reports their median. When the first call took longer than ``--warmup-limit`` seconds it
   counts as the first of the repeats instead of being discarded (``warmup_discarded`` = false),
   and no further call starts that would likely end past ``--timeout-per-cell``
   (``repeats_done`` says how many calls the median is over).

The history itself (L * D * N * 4 bytes, kept on the server's device) is reported apart from
the step's working memory; so are the rows of D per chunk and the number of chunks
(``--chunk-size``, 0 = the library's automatic size). The table's working memory is the GPU's
on CUDA (the host RSS increase is its last column) and the host's on CPU. It is measured on the
first call, from a fresh process, because the allocator may keep freed pages resident for the
later calls.

The parent writes ``results-<device>.json`` (every cell, settings, machine) and
``table-<device>.md`` under ``--out`` after each cell (replacing them; with ``--merge`` the cells
already there that this run does not measure are kept, so the grid can be measured in several
invocations), and prints the table at the end. A cell
that times out, runs out of memory or fails is recorded as such, and cells at least as large in
D, N and L as a timed-out or out-of-memory cell are skipped (``--no-skip-larger`` runs them).

Only ``fedfm_flower.learners`` and torch are imported: no Flower needed on the benchmark machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from fedfm_flower.methods.pfedseq import SCAN_BACKENDS
from fedfm_flower.records.durable import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "pfedseq_server_step"
LAYER_NAME = "blocks.{k}.lora.weight"
PATHS = ("loop", "batched", "compiled", "fused")
QUICK_CELLS = ((4096, 10, 5), (4096, 100, 5), (16384, 10, 5), (4096, 10, 10))
QUICK_LAYERS = 4
UPDATE_STD = 1e-3
RESULT_PREFIX = "RESULT "
MIB = float(1 << 20)


def count(text: str) -> int:
    """An integer from the command line, accepting ``1e6`` notation."""
    value = float(text)
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(value)


# --------------------------------------------------------------------------- memory
def proc_status_kib(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM), or None where there is none."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM); whether that worked."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return proc_status_kib("VmHWM") is not None


class RSSSampler:
    """Peak VmRSS seen by a background thread (used where VmHWM cannot be reset)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak_kib = proc_status_kib("VmRSS") or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, proc_status_kib("VmRSS") or 0)
            time.sleep(self.interval)

    def __enter__(self) -> RSSSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, proc_status_kib("VmRSS") or 0)


# --------------------------------------------------------------------------- one cell (child)
def build_server(
    d: int,
    n: int,
    seq_len: int,
    device: str,
    learner: str,
    backend: str,
    chunk_size: int,
    layers: int = 1,
    batch_layers: bool = True,
) -> Any:
    """A server with ``layers`` layers, ``d`` parameters in all, and L random rounds of history."""
    from fedfm_flower.learners.pfedseq import PFedSeqServer, PFedSeqSettings

    settings = PFedSeqSettings(
        seq_len=seq_len,
        warmup_rounds=seq_len,
        chunk_size=chunk_size,
        learner=learner,
        scan_backend=backend,
    )
    sizes = [d // layers + (1 if k < d % layers else 0) for k in range(layers)]
    adapter = {LAYER_NAME.format(k=k): torch.zeros(size) for k, size in enumerate(sizes)}
    server = PFedSeqServer(settings, adapter, n, seed=0, device=device, batch_layers=batch_layers)
    generator = torch.Generator().manual_seed(1)
    server.history = [  # where the server keeps it: its device, as step() appends
        torch.empty(d, n).normal_(0.0, UPDATE_STD, generator=generator).to(server.device)
        for _ in range(seq_len)
    ]
    server.masks = [torch.ones(n) for _ in range(seq_len)]
    server.round = seq_len  # == warmup_rounds: the next step is the first one past the warm-up
    return server


def learner_calls(server: Any, seq_len: int) -> dict[str, int]:
    """Rows per learner call (the largest) and learner calls per pass over the D rows."""
    if server.batch_layers:
        chunks = server.layer_chunks(seq_len)
        rows = max(sum(len(r) for _, r in chunk) for chunk in chunks)
        return {"chunk_rows": rows, "chunks": len(chunks)}
    step = server.chunk_rows(seq_len)
    sizes = [layer.size for layer in server.layout.layers]
    return {
        "chunk_rows": min(max(sizes), step),
        "chunks": sum(math.ceil(size / step) for size in sizes),
    }


def synchronize(device: str) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def run_cell(args: argparse.Namespace) -> dict[str, Any]:
    """Measure one (D, N, L) cell in this process; returns its JSON-ready record."""
    cell_started = time.perf_counter()
    d, n, seq_len = args.cell
    device = args.device
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    server = build_server(
        d,
        n,
        seq_len,
        device,
        args.learner,
        args.path if args.path in ("compiled", "fused") else args.backend,
        args.chunk_size,
        args.layers,
        args.path != "loop",
    )
    generator = torch.Generator().manual_seed(2)
    updates = {c: torch.empty(d).normal_(0.0, UPDATE_STD, generator=generator) for c in range(n)}
    num_examples = {c: 100 for c in range(n)}

    # first call: peak working memory (and warm-up)
    gc.collect()
    synchronize(device)
    cuda_base = 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    rss_before = proc_status_kib("VmRSS") or 0
    hwm_reset = reset_peak_rss()
    sampler = None if hwm_reset else RSSSampler()
    with sampler or contextlib.nullcontext():
        started = time.perf_counter()
        stats = server.step(updates, num_examples)
        synchronize(device)
        first_seconds = time.perf_counter() - started
    rss_peak = sampler.peak_kib if sampler else proc_status_kib("VmHWM") or 0
    record: dict[str, Any] = {
        "d": d,
        "n": n,
        "l": seq_len,
        "layers": args.layers,
        "path": args.path,
        "status": "ok",
        **learner_calls(server, seq_len),
        "learner_parameters": server.num_learner_parameters(),
        "history_bytes": seq_len * d * n * 4,
        "rss_before_mib": rss_before * 1024 / MIB,
        "peak_rss_increase_mib": max(0, rss_peak - rss_before) * 1024 / MIB,
        "peak_rss_method": "VmHWM after clear_refs" if hwm_reset else "VmRSS sampler thread",
        "first_call_seconds": first_seconds,
        "past_warmup": stats["pfedseq-warmup"] == 0.0,
    }
    if device == "cuda":
        record["cuda_peak_increase_mib"] = (torch.cuda.max_memory_allocated() - cuda_base) / MIB
        record["cuda_allocated_before_mib"] = cuda_base / MIB

    # timed calls
    discard = first_seconds <= args.warmup_limit
    times = [] if discard else [first_seconds]
    server_seconds = [] if discard else [stats["pfedseq-server-seconds"]]
    while len(times) < args.repeats:
        if times and time.perf_counter() - cell_started + max(times) > 0.9 * args.budget:
            break  # another call would likely run past the parent's timeout
        synchronize(device)
        started = time.perf_counter()
        stats = server.step(updates, num_examples)
        synchronize(device)
        times.append(time.perf_counter() - started)
        server_seconds.append(stats["pfedseq-server-seconds"])
    record.update(
        {
            "warmup_discarded": discard,
            "repeats_done": len(times),
            "step_seconds": statistics.median(times),
            "step_seconds_all": times,
            "server_seconds_median": statistics.median(server_seconds),
            "calibration_rms": stats.get("pfedseq-calibration-rms"),
        }
    )
    return record


def child_main(args: argparse.Namespace) -> int:
    """Entry point of a ``--cell`` child: print one RESULT line of JSON."""
    try:
        record = run_cell(args)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as error:
        if not isinstance(error, torch.cuda.OutOfMemoryError) and (
            "can't allocate memory" not in str(error)
        ):
            raise
        d, n, seq_len = args.cell
        record = {
            **cell_key(d, n, seq_len, args.layers, args.path),
            "status": "oom",
            "error": str(error)[:500],
        }
    print(RESULT_PREFIX + json.dumps(record), flush=True)
    return 0


# --------------------------------------------------------------------------- the grid (parent)
def git_commit() -> str | None:
    """``git rev-parse HEAD`` of the repository (with ``-dirty`` if it has changes), or None."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("-dirty" if dirty else "")


def machine_info(device: str) -> dict[str, Any]:
    """Platform, CPUs, memory, torch, GPU and kernels, date and git commit of this run."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
    }
    try:
        meminfo = Path("/proc/meminfo").read_text()
        total = re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.MULTILINE)
        info["memory_gib"] = int(total.group(1)) / (1 << 20) if total else None
    except OSError:
        info["memory_gib"] = None
    if device == "cuda":
        from fedfm_flower.learners.selective_scan import kernels

        properties = torch.cuda.get_device_properties(0)
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = properties.total_memory / (1 << 30)
        info["cuda"] = torch.version.cuda
        info["kernels"] = sorted(kernels())
    return info


def fmt(value: float | None, digits: int = 3) -> str:
    """A number for the table, with ``digits`` significant digits."""
    return "-" if value is None else f"{value:.{digits}g}"


KEY = ("d", "n", "l", "layers", "path")


def cell_key(d: int, n: int, seq_len: int, layers: int, path: str) -> dict[str, Any]:
    """The fields that name one measured cell."""
    return {"d": d, "n": n, "l": seq_len, "layers": layers, "path": path}


def with_defaults(record: dict[str, Any]) -> dict[str, Any]:
    """A record of an earlier run (before layers and paths): one layer, the per-layer loop."""
    return {"layers": 1, "path": "loop", **record}


def working_mib(record: dict[str, Any], device: str) -> float:
    """The step's peak working memory: the GPU's on CUDA, the host's on CPU."""
    key = "cuda_peak_increase_mib" if device == "cuda" else "peak_rss_increase_mib"
    return record[key]


def path_cells(record: dict[str, Any] | None, device: str) -> dict[str, str]:
    """One path's table entries: step seconds, calls x rows, memory (or its status)."""
    if record is None:
        return {"step": "-", "calls": "-", "memory": "-", "host": "-"}
    if record["status"] != "ok":
        return {"step": record["status"], "calls": "-", "memory": "-", "host": "-"}
    return {
        "step": fmt(record["step_seconds"]),
        "calls": f"{record['chunks']} x {record['chunk_rows']}",
        "memory": fmt(working_mib(record, device)),
        "host": fmt(record["peak_rss_increase_mib"]),
    }


def share(record: dict[str, Any] | None, round_rest: float | None) -> str:
    """step / (rest of the round + step), as a percentage."""
    if record is None or record["status"] != "ok" or round_rest is None:
        return "-"
    step = record["step_seconds"]
    return f"{100 * step / (round_rest + step):.1f}%"


def table(
    records: list[dict[str, Any]],
    device: str,
    round_rest: float | None = None,
    pair: tuple[str, str] = ("loop", "batched"),
) -> str:
    """The markdown table: one row per (D, N, L, layers), the ``pair`` of paths side by side."""
    rows: dict[tuple, dict[str, dict[str, Any]]] = {}
    for record in map(with_defaults, records):
        key = (record["d"], record["n"], record["l"], record["layers"])
        rows.setdefault(key, {})[record["path"]] = record
    first, second = pair
    both = f"{first} / {second}"
    header = ["D", "N", "L", "layers", f"{first} step s", f"{second} step s", both]
    if round_rest is not None:
        header += [f"{first} share of a round", f"{second} share of a round"]
    header += [f"learner calls x rows, {both}", f"peak working memory MiB, {both}", "history MiB"]
    if device == "cuda":
        header.append(f"host peak RSS MiB, {both}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for (d, n, seq_len, layers), paths in rows.items():
        loop, batched = paths.get(first), paths.get(second)
        a, b = path_cells(loop, device), path_cells(batched, device)
        both_ok = loop and batched and loop["status"] == batched["status"] == "ok"
        ratio = fmt(loop["step_seconds"] / batched["step_seconds"]) if both_ok else "-"
        cells = [f"{d:.3g}", str(n), str(seq_len), str(layers), a["step"], b["step"], ratio]
        if round_rest is not None:
            cells += [share(loop, round_rest), share(batched, round_rest)]
        cells += [
            f"{a['calls']} / {b['calls']}",
            f"{a['memory']} / {b['memory']}",
            fmt(seq_len * d * n * 4 / MIB),
        ]
        if device == "cuda":
            cells.append(f"{a['host']} / {b['host']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_child(
    args: argparse.Namespace, d: int, n: int, seq_len: int, path: str = "batched"
) -> dict[str, Any]:
    """Run one cell of one path in a child process; its record, or a timeout/oom/error record."""
    command = [
        sys.executable,
        "-m",
        "bench.pfedseq_server_step",
        "--cell",
        str(d),
        str(n),
        str(seq_len),
        "--path",
        path,
        "--layers",
        str(args.layers),
        "--device",
        args.device,
        "--learner",
        args.learner,
        "--backend",
        args.backend,
        "--chunk-size",
        str(args.chunk_size),
        "--repeats",
        str(args.repeats),
        "--warmup-limit",
        str(args.warmup_limit),
        "--threads",
        str(args.threads),
        "--budget",
        str(args.timeout),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    base = cell_key(d, n, seq_len, args.layers, path)
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {**base, "status": "timeout", "error": f"over {args.timeout:g} s"}
    wall = time.perf_counter() - started
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            record = json.loads(line[len(RESULT_PREFIX) :])
            record["cell_wall_seconds"] = wall
            return record
    if done.returncode < 0:
        status = "oom" if done.returncode == -9 else f"signal {-done.returncode}"
        error = f"killed by signal {-done.returncode} (-9: likely the out-of-memory killer)"
    else:
        status, error = "error", f"exit code {done.returncode}"
    return {**base, "status": status, "error": error, "stderr_tail": done.stderr[-2000:]}


def load_earlier(
    path: Path, merge: bool, settings: dict[str, Any], must_match: tuple[str, ...]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """With ``merge``, the cells and machines already in ``path`` (same ``must_match`` settings)."""
    if not merge or not path.exists():
        return [], []
    earlier = json.loads(path.read_text())
    for key in must_match:
        if earlier["settings"].get(key) != settings.get(key):
            raise SystemExit(
                f"--merge: {path} was measured with {key} = {earlier['settings'].get(key)!r}, "
                f"this run uses {settings.get(key)!r}; use another --out"
            )
    machines = earlier.get("earlier_machines", []) + [earlier["machine"]]
    return earlier["cells"], machines


def merged(
    earlier: list[dict[str, Any]], records: list[dict[str, Any]], key: tuple[str, ...]
) -> list[dict[str, Any]]:
    """``earlier`` cells not measured again, plus ``records``, sorted by ``key``."""
    fresh = {tuple(r[k] for k in key) for r in records}
    kept = [r for r in earlier if tuple(r[k] for k in key) not in fresh]
    return sorted(kept + records, key=lambda r: tuple(r[k] for k in key))


def dominated(d: int, n: int, seq_len: int, failed: list[tuple[int, int, int]]) -> bool:
    """Whether the cell is at least as large in D, N and L as a timed-out/oom cell."""
    return any(d >= fd and n >= fn and seq_len >= fl for fd, fn, fl in failed)


def grid(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """The (D, N, L) cells to measure: ``--quick``'s points or the product of --d, --n, --l."""
    if args.quick:
        return list(QUICK_CELLS)
    return [(d, n, seq_len) for d in args.d for n in args.n for seq_len in args.l]


def parent_main(args: argparse.Namespace) -> int:
    """Run the grid cell by cell, each path in turn; write results and table after each cell."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"{args.device}-quick" if args.quick else args.device
    json_path = out / f"results-{suffix}.json"
    table_path = out / f"table-{suffix}.md"
    settings = {
        "device": args.device,
        "learner": args.learner,
        "backend": args.backend,
        "chunk_size": args.chunk_size,
        "repeats": args.repeats,
        "warmup_limit": args.warmup_limit,
        "timeout_per_cell": args.timeout,
        "threads": args.threads,
        "layer": LAYER_NAME,
        "layers": args.layers,
        "paths": args.paths,
        "round_rest_seconds": args.round_rest,
        "update_std": UPDATE_STD,
    }
    machine = machine_info(args.device)
    must_match = ("device", "learner", "backend", "chunk_size", "threads")
    earlier, machines = load_earlier(json_path, args.merge, settings, must_match)
    earlier = [with_defaults(r) for r in earlier]
    records: list[dict[str, Any]] = []
    first, second = (args.paths + [p for p in PATHS if p not in args.paths])[:2]
    pair = (first, second)
    failed: dict[str, list[tuple[int, int, int]]] = {path: [] for path in args.paths}
    title = (
        f"pFedSeq server step, {args.device}, learner {args.learner}, backend {args.backend}, "
        f"chunk-size {args.chunk_size}, {args.layers} layer(s), threads {args.threads or 'default'}"
    )
    for d, n, seq_len in grid(args):
        for path in args.paths:
            if not args.no_skip_larger and dominated(d, n, seq_len, failed[path]):
                record = {**cell_key(d, n, seq_len, args.layers, path), "status": "skipped"}
            else:
                record = run_child(args, d, n, seq_len, path)
            if record["status"] in ("timeout", "oom"):
                failed[path].append((d, n, seq_len))
            records.append(record)
            shown = (
                f"{record['step_seconds']:.3g} s" if record["status"] == "ok" else record["status"]
            )
            print(f"D={d:.3g} N={n} L={seq_len} {path}: {shown}", flush=True)
            cells = merged(earlier, records, KEY)
            payload = {"settings": settings, "machine": machine, "cells": cells}
            if machines:
                payload["earlier_machines"] = machines
            # Atomic, not durable: a kill mid-write must not lose the earlier cells.
            atomic_write_text(json_path, json.dumps(payload, indent=2) + "\n", durable=False)
            text = table(cells, args.device, args.round_rest, pair)
            atomic_write_text(table_path, f"{title}\n\n{text}", durable=False)
    print()
    print(table(merged(earlier, records, KEY), args.device, args.round_rest, pair), end="")
    print(f"\nwrote {json_path} and {table_path}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    parser.add_argument("--d", type=count, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--n", type=count, nargs="+", default=[10, 100])
    parser.add_argument("--l", type=count, nargs="+", default=[5, 20])
    parser.add_argument(
        "--layers",
        type=count,
        default=None,
        help=f"adapter layers sharing the D parameters (default 1; {QUICK_LAYERS} with --quick)",
    )
    parser.add_argument(
        "--paths",
        choices=PATHS,
        nargs="+",
        default=["loop", "batched"],
        help="server paths to measure: the per-layer loop, the layer-batched path (with "
        "--backend), the batched path with compiled scan steps or with the fused C scan (the "
        "table compares the first two)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the offline setups' shape: 4 layers, the suite's server-cost points",
    )
    parser.add_argument(
        "--round-rest",
        type=float,
        default=None,
        help="seconds of a round outside the server step; adds each path's share of a round",
    )
    parser.add_argument("--learner", choices=["mamba", "lstm", "mlp"], default="mamba")
    parser.add_argument("--backend", choices=list(SCAN_BACKENDS), default="auto")
    parser.add_argument("--chunk-size", type=int, default=0, help="rows of D per chunk; 0 = auto")
    parser.add_argument("--repeats", type=count, default=3, help="timed steps (median)")
    parser.add_argument(
        "--warmup-limit",
        type=float,
        default=60.0,
        help="a first call slower than this (s) is timed instead of discarded",
    )
    parser.add_argument(
        "--timeout-per-cell", dest="timeout", type=float, default=900.0, help="seconds"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = default")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the cells already in --out that this run does not measure again",
    )
    parser.add_argument(
        "--no-skip-larger",
        action="store_true",
        help="also run cells at least as large as a timed-out or out-of-memory one",
    )
    parser.add_argument("--budget", type=float, default=math.inf, help=argparse.SUPPRESS)
    parser.add_argument(
        "--cell", type=count, nargs=3, metavar=("D", "N", "L"), help=argparse.SUPPRESS
    )
    parser.add_argument("--path", choices=PATHS, default="batched", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layers is None:
        args.layers = QUICK_LAYERS if args.quick else 1
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    if args.chunk_size < 0:
        parser.error("--chunk-size must be >= 0")
    if not args.quick and min(args.d) < args.layers:
        parser.error(f"--d must be at least --layers ({args.layers}): every layer needs a row")
    if args.round_rest is not None and args.round_rest < 0:
        parser.error("--round-rest must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the grid, or one cell when called with ``--cell``."""
    args = parse_args(argv)
    return child_main(args) if args.cell else parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
