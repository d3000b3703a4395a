"""Simulation overhead: the same FedAvg experiment as a bare PyTorch loop and through `flwr run`.

    python -m bench.simulation_overhead --clients 10 100 --rounds 4 [--set key=value ...]

For each client count N both sides run in fresh processes, one after the other, with the same
run config, seed and threads per client:

* (a) ``bench.bare_loop``: one process, no Flower, clients trained and evaluated in sequence;
* (b) ``python -m fedfm_flower.simulation`` (``flwr run``, N SuperNodes; on the CPU the
  ClientApps run in forked workers, ``fedfm_flower.simulation.fork_engine``, else in Ray's actors)
  with ``client-resources-num-cpus`` = all usable CPUs, so the simulation also runs one client at a
  time with the same number of torch threads; the framework adds messages, records, the
  ClientApp's per-message set-up, the strategy, checkpoints and results.

Reported per N: steady-state round time (median of rounds 2..R-1) of (b) over (a), the first
round's extra time and the launch time of (b) (``flwr run`` until round 1 starts), peak memory
(summed PSS of every process of the run; on a GPU machine also the GPU's), and whether both
sides reached the same accuracies.

On a GPU (``--gpu-fractions 1 0.25``) (b) runs once per GPU share: with share f, Ray runs
1/f clients at once on the GPU, each with usable CPUs * f CPUs. Share 1 is the like-for-like
comparison with the bare loop (one client at a time); smaller shares show what concurrency buys.
The accuracies then agree only to within the GPU's non-deterministic kernels (reported as the
difference of the final mean accuracies).

``--engines prompt ray flower`` runs (b) once per engine per N, one after the other against the
same bare loop: ``prompt``, the defaults (forked workers on the CPU, the prompt hand-offs of
``fedfm_flower.simulation.prompt_engine``); ``ray``, Ray's actors with the prompt hand-offs
(``FEDFM_SIMULATION_ENGINE=ray``); ``flower``, Flower's engine as it is (Ray's actors, its 0.1 s
hand-offs: ``FEDFM_PROMPT_ENGINE=0`` too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.process_memory import TAG_VAR, PeakMemory
from fedfm_flower.config.overrides import parse_overrides, to_set_args
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.simulation.processes import exit_on_sigterm, stop_tagged

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("prompt", "ray", "flower")
# A timing benchmark, not an experiment: 100 clients of the digits hold a handful of examples
# each, below the run config's default minimum partition size.
TIMING_MINIMUMS = {"min-train-examples": 1, "min-test-examples": 1}


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def toml_pairs(config: dict[str, Any]) -> str:
    """``k=v`` pairs for ``flwr run --run-config`` (TOML values)."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())


def run_tagged(command: list[str], env: dict[str, str], log_path: Path) -> tuple[float, PeakMemory]:
    """Run ``command`` to completion with a fresh tag; (wall seconds, peak memory)."""
    tag = uuid.uuid4().hex
    env = {**env, TAG_VAR: tag}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        with log_path.open("w") as log, PeakMemory(tag) as memory:
            process = subprocess.run(
                command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False
            )
    finally:  # also when this benchmark is stopped: nothing of the run may outlive it
        wall = time.perf_counter() - started
        stop_tagged({TAG_VAR: tag})
    if process.returncode != 0:
        raise RuntimeError(f"{command[:4]} failed ({process.returncode}); log {log_path}")
    return wall, memory


def steady(seconds: list[float]) -> float:
    """Median time of rounds 2..R-1: what a round costs in a long run.

    Round 1 pays the start-up; with fused evaluation round R also carries the final
    evaluate-only phase (a whole extra message per client in deployment). With 2 rounds this
    is round 2, with 1 round round 1.
    """
    middle = seconds[1:-1] or seconds[1:] or seconds
    return statistics.median(middle)


def run_bare(num_clients: int, rounds: int, threads: int, config: dict, workdir: Path) -> dict:
    """The bare loop in a fresh process."""
    command = [
        sys.executable,
        "-m",
        "bench.bare_loop",
        "--num-clients",
        str(num_clients),
        "--rounds",
        str(rounds),
        "--threads",
        str(threads),
    ]
    command += to_set_args(config)
    log = workdir / f"bare-{num_clients}.log"
    wall, memory = run_tagged(command, dict(os.environ), log)
    result = json.loads(log.read_text().strip().splitlines()[-1])
    if result["flwr-imported"]:
        raise RuntimeError(f"the bare loop imported Flower: {result['flwr-imported'][:5]}")
    seconds = [r["round-seconds"] for r in result["rounds"]]
    return {
        "wall-s": wall,
        "round-s": seconds,
        "steady-round-s": steady(seconds),
        "peak-pss-bytes": memory.peak_bytes,
        "peak-gpu-bytes": memory.peak_gpu_bytes,
        "final-accuracy": result["rounds"][-1]["test-accuracy-mean"],
    }


def simulation_run_config(num_clients: int, config: dict, workdir: Path, name: str) -> dict:
    """The run config of one simulation of the benchmark: its results go to
    ``<workdir>/runs/<name>``."""
    return {
        **TIMING_MINIMUMS,
        **config,
        "num-clients": num_clients,
        "output-dir": str(workdir / "runs"),
        "run-name": name,
    }


def simulation_result(
    run_dir: Path, rounds: int, wall: float, memory: PeakMemory | None = None
) -> dict:
    """One simulation's figures from its run directory (``metrics.jsonl``), its wall time and
    the peak memory of its processes (None: not measured)."""
    records = RunDirectory(run_dir).rounds()
    if len(records) != rounds:
        # `flwr run` exits 0 even when the ServerApp failed: check the results instead.
        raise RuntimeError(f"run {run_dir.name} wrote {len(records)} of {rounds} rounds; {run_dir}")
    seconds = [r["round-seconds"] for r in records]
    # A SuperLink already listening on Flower's local address (one an earlier command left
    # behind) runs the simulation in its own, untagged processes: their memory is not ours.
    measured = memory is not None and "flwr-simulation" in memory.by_command
    if memory is not None and not measured:
        print(
            f"run {run_dir.name}: the simulation ran outside the processes this benchmark "
            "started (a SuperLink left running?); its host memory is not reported",
            flush=True,
        )
    return {
        "wall-s": wall,
        "launch-s": wall - sum(seconds),
        "round-s": seconds,
        "steady-round-s": steady(seconds),
        "server-s": [r["server-seconds"] for r in records],
        "bytes-up": [r["bytes-up-train"] for r in records],
        "bytes-down": [r["bytes-down-train"] for r in records],
        "clients-reported": [r["clients-reported"] for r in records],
        "peak-pss-bytes": memory.peak_bytes if measured else None,
        "peak-gpu-bytes": memory.peak_gpu_bytes if memory is not None else None,
        "peak-processes": memory.peak_processes if measured else None,
        "peak-pss-by-command": memory.by_command if memory is not None else {},
        "final-accuracy": records[-1].get("test-accuracy-mean"),
    }


def run_flower_simulation(
    num_clients: int,
    rounds: int,
    client_cpus: int,
    config: dict,
    workdir: Path,
    name: str,
    gpu_fraction: float = 0.0,
    engine: str = "prompt",
) -> dict:
    """`flwr run` simulation in fresh processes; timings from the run's metrics.jsonl.
    ``engine``: ``prompt`` (the defaults), ``ray`` (Ray's actors) or ``flower`` (Ray's actors
    and Flower's 0.1 s hand-offs)."""
    run_config = simulation_run_config(num_clients, config, workdir, name)
    command = [
        sys.executable,
        "-m",
        "fedfm_flower.simulation",
        "--num-supernodes",
        str(num_clients),
        "--client-cpus",
        str(client_cpus),
        "--gpu-fraction",
        str(gpu_fraction),
        "--",
        "--run-config",
        toml_pairs(run_config),
    ]
    env = {
        **os.environ,
        "FLWR_HOME": str(workdir / "flwr-home"),
        "FEDFM_PROMPT_ENGINE": "0" if engine == "flower" else "1",
        "FEDFM_SIMULATION_ENGINE": "fork" if engine == "prompt" else "ray",
    }
    run_dir = Path(run_config["output-dir"]) / name
    shutil.rmtree(run_dir, ignore_errors=True)  # results of an earlier invocation
    wall, memory = run_tagged(command, env, workdir / f"{name}.log")
    return simulation_result(run_dir, rounds, wall, memory)


def share_resources(gpu_fraction: float, cpus: int) -> tuple[int, int]:
    """(clients Ray runs at once, CPUs per client) for a GPU share (0 = CPU only)."""
    if gpu_fraction < 0 or gpu_fraction > 1:
        raise ValueError(f"GPU share must be in [0, 1], got {gpu_fraction}")
    if gpu_fraction == 0:
        return 1, cpus
    parallel = int(1 / gpu_fraction + 1e-9)
    return parallel, max(1, cpus // parallel)


def measure(
    clients: list[int],
    rounds: int,
    config: dict,
    workdir: Path,
    gpu_fractions: tuple[float, ...] = (0.0,),
    engines: tuple[str, ...] = ("prompt",),
) -> list[dict]:
    """Both sides for each client count (and GPU share, engine); a row per (N, share, engine)."""
    cpus = usable_cpus()
    rows = []
    for num_clients in clients:
        bare = run_bare(num_clients, rounds, cpus, config, workdir)
        for fraction, engine in [(f, e) for f in gpu_fractions for e in engines]:
            parallel, client_cpus = share_resources(fraction, cpus)
            name = f"fedavg-{num_clients}" + (f"-gpu{fraction:g}" if fraction else "")
            name += "" if engine == "prompt" else f"-{engine}"
            flower = run_flower_simulation(
                num_clients,
                rounds,
                client_cpus,
                {**config, "method": "fedavg"},
                workdir,
                name,
                fraction,
                engine,
            )
            difference = abs(flower["final-accuracy"] - bare["final-accuracy"])
            rows.append(
                {
                    "clients": num_clients,
                    "rounds": rounds,
                    "backbone": config.get("backbone", "tiny-vit"),
                    "gpu-fraction": fraction,
                    "engine": engine,
                    "parallel-clients": parallel,
                    "threads-per-client": client_cpus,
                    "bare": bare,
                    "simulation": flower,
                    "steady-ratio": flower["steady-round-s"] / bare["steady-round-s"],
                    "first-round-extra-s": flower["round-s"][0] - flower["steady-round-s"],
                    "same-accuracy": difference < 1e-9,
                    "accuracy-difference": difference,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: measure and print the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "work" / "overhead")
    parser.add_argument(
        "--gpu-fractions", type=float, nargs="+", default=[0.0], help="GPU share per client"
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=["prompt"],
        help="prompt: the defaults (forked workers on the CPU); ray: Ray's actors; flower: Ray's "
        "actors and Flower's 0.1 s hand-offs",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    config: dict[str, Any] = {"num-server-rounds": args.rounds, "seed": 0}
    config.update(parse_overrides(args.set))
    measure(
        args.clients,
        args.rounds,
        config,
        args.workdir,
        tuple(args.gpu_fractions),
        tuple(args.engines),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
