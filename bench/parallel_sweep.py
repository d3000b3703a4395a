"""Wall time of one sweep run serially and as parallel Ray cells on this machine.

    python -m bench.parallel_sweep [--methods fedavg local fedrep fedavg-ft] [--seeds 0 1]
        [--rounds 5] [--clients 10] [--out bench/results/parallel_sweep]

Both runs build the same cells (``fedfm_flower.study.sweep.build_cells``) into fresh directories:
the serial pool in this process (torch's default threads), then a Ray instance started here with one
CPU per cell (Ray gives each cell one thread) and as many cells at once as the machine has
cores. The Ray time includes starting Ray and its workers. The record also says whether every
run's per-round metrics (wall-clock values aside) are equal between the two.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from fedfm_flower.records.durable import atomic_write_text
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.study.pools import RayPool, RayResources, SerialPool
from fedfm_flower.study.sweep import build_cells, run_sweep


def _metrics(run: Path) -> list[Any]:
    return RunDirectory(run).rounds_without_times()


def _timed_sweep(args: argparse.Namespace, out: Path, pool: Any) -> tuple[float, list[Any]]:
    overrides = {
        "num-server-rounds": args.rounds,
        "num-clients": args.clients,
        "cache-dir": args.cache_dir,
    }
    cells = build_cells(args.methods, [args.setup], args.seeds, out, overrides)
    started = time.perf_counter()
    try:
        records = run_sweep(cells, out, pool)
    finally:
        pool.close()
    seconds = time.perf_counter() - started
    failed = [r for r in records if r["state"] != "done"]
    if failed:
        raise RuntimeError(f"{len(failed)} cells failed: {failed[0].get('error')}")
    return seconds, [_metrics(cell.run_dir) for cell in cells]


def main(argv: list[str] | None = None) -> int:
    """Run both sweeps; write and print the record."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=["fedavg", "local", "fedrep", "fedavg-ft"])
    parser.add_argument("--setup", default="digits-label-skew")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "fedfm-cache"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/parallel_sweep"))
    args = parser.parse_args(argv)
    from fedfm_flower.records.logs import configure_logging

    configure_logging()
    # the foundation model is built once, before either timing
    _timed_sweep(
        argparse.Namespace(**{**vars(args), "methods": ["local"], "seeds": [0], "rounds": 1}),
        Path(tempfile.mkdtemp(prefix="warm-")),
        SerialPool(),
    )
    with tempfile.TemporaryDirectory() as scratch:
        serial_s, serial = _timed_sweep(args, Path(scratch) / "serial", SerialPool())
        cores = os.cpu_count() or 1
        ray_s, parallel = _timed_sweep(args, Path(scratch) / "ray", RayPool(RayResources(cpus=1)))
    record = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": f"{platform.machine()}, {cores} cores",
        "cells": len(args.methods) * len(args.seeds),
        "methods": args.methods,
        "setup": args.setup,
        "seeds": args.seeds,
        "rounds": args.rounds,
        "clients": args.clients,
        "serial-seconds": round(serial_s, 1),
        "ray-seconds": round(ray_s, 1),
        "speedup": round(serial_s / ray_s, 2),
        "cells-at-once": cores,
        "results-equal": serial == parallel,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / f"{record['when']}.json", json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
