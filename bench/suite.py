"""The benchmark suite: what the framework costs over the bare compute, and how it grows.

    python -m bench.suite --quick      # CPU, offline setup, ~8 minutes on 2 cores
    python -m bench.suite --full       # more clients, rounds and SuperNodes; meant for a GPU box

Sections (each also runs alone, see its module):

1. ``simulation_overhead``: the same FedAvg experiment as a bare PyTorch loop and through
   ``flwr run`` simulation, at 10 and 100 clients; also the peak memory of both (item 5).
2. ``server_cost``: each strategy's own work per round against N, D and L, plus its fraction of
   a simulated round (``server-seconds`` / ``round-seconds`` from ``flwr run`` simulations).
3. ``communication``: bytes on the wire per client and round against the parameters' bytes.
4. ``deployment_rounds``: loopback deployment with 2 (and 4) SuperNodes against simulation;
   the per-message ClientApp cold start is ``bench.clientapp_cold_start`` (run in ``--full``).

Writes ``bench/results/suite/results-<mode>.json`` and ``tables-<mode>.md`` and replaces the
block between ``<!-- bench:<mode>:begin -->`` and ``<!-- bench:<mode>:end -->`` in
``docs/benchmarks.md`` with the tables.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import communication, deployment_rounds, server_cost, simulation_overhead
from bench.overrides import parse_overrides

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "suite"
DOC = ROOT / "docs" / "benchmarks.md"
MIB = 1024 * 1024

MODES: dict[str, dict[str, Any]] = {
    "quick": {
        "clients": [10, 100],
        "rounds": 4,
        "server-clients": [10, 100],
        "ranks": [4, 16],
        "seq-lens": [5, 10],
        "fraction-methods": ["fedrep", "pfedseq", "pfedpg"],
        "supernodes": [2],
        "deploy-rounds": 3,
        "cold-start": False,
    },
    "full": {
        "clients": [10, 100],
        "rounds": 6,
        "server-clients": [10, 100, 1000],
        "ranks": [4, 16, 64],
        "seq-lens": [5, 10, 20],
        "fraction-methods": ["fedrep", "pfedseq", "pfedpg"],
        "supernodes": [2, 4],
        "deploy-rounds": 4,
        "cold-start": True,
    },
}


def machine() -> dict[str, Any]:
    """Where the figures come from."""
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": dt.date.today().isoformat(),
        "commit": commit,
        "cpus": simulation_overhead.usable_cpus(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def server_fractions(
    methods: list[str], rounds: int, config: dict, workdir: Path, overhead: list[dict]
) -> list[dict]:
    """Server seconds over round seconds (steady rounds) of simulations with 10 clients."""
    rows = []
    runs = {"fedavg": next(r["simulation"] for r in overhead if r["clients"] == 10)}
    for method in methods:
        runs[method] = simulation_overhead.run_flower_simulation(
            10, rounds, 1, {**config, "method": method}, workdir, f"{method}-10"
        )
    for method, run in runs.items():
        server = simulation_overhead.steady(run["server-s"])
        round_s = run["steady-round-s"]
        rows.append(
            {"method": method, "server-s": server, "round-s": round_s, "fraction": server / round_s}
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run_suite(mode: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Every section; the combined results."""
    plan = MODES[mode]
    workdir = ROOT / "bench" / "work" / f"suite-{mode}"
    config = {"seed": 0, "num-server-rounds": plan["rounds"], **overrides}
    started = time.perf_counter()
    results: dict[str, Any] = {"mode": mode, "machine": machine(), "config": config}
    results["overhead"] = simulation_overhead.measure(
        plan["clients"], plan["rounds"], config, workdir / "overhead"
    )
    results["server-fraction"] = server_fractions(
        plan["fraction-methods"], plan["rounds"], config, workdir / "fraction", results["overhead"]
    )
    results["server-cost"] = server_cost.measure(
        list(server_cost.METHODS),
        plan["server-clients"],
        plan["ranks"],
        plan["seq-lens"],
        overrides,
    )
    results["communication"] = communication.measure(list(communication.METHODS), overrides)
    results["deployment"] = deployment_rounds.measure(
        plan["supernodes"], plan["deploy-rounds"], {"seed": 0, **overrides}, workdir / "deploy"
    )
    if plan["cold-start"]:
        subprocess.run([sys.executable, "-m", "bench.clientapp_cold_start"], cwd=ROOT, check=True)
    cold = ROOT / "bench" / "results" / "clientapp_cold_start" / "results.json"
    results["cold-start"] = json.loads(cold.read_text()) if cold.exists() else None
    results["seconds"] = time.perf_counter() - started
    return results


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def tables(results: dict[str, Any]) -> str:
    """The markdown tables of one suite run."""
    m = results["machine"]
    lines = [
        f"Measured {m['date']} at commit `{m['commit']}` on {m['cpus']} CPU(s) "
        f"({m['processor']}), GPU: {m['gpu'] or 'none'}, torch {m['torch']}, "
        f"mode `{results['mode']}`, {results['seconds'] / 60:.1f} min in all.",
        "",
        "**1. Simulation overhead** (FedAvg; steady = median of rounds 2..R; launch = `flwr run`"
        " until round 1 starts)",
        "",
        "| clients | bare round s | flwr round s | ratio (target <= 1.10) | first-round extra s "
        "| launch s | same accuracy |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in results["overhead"]:
        lines.append(
            f"| {row['clients']} | {_fmt(row['bare']['steady-round-s'])} "
            f"| {_fmt(row['simulation']['steady-round-s'])} | {_fmt(row['steady-ratio'])} "
            f"| {_fmt(row['first-round-extra-s'])} | {_fmt(row['simulation']['launch-s'], 1)} "
            f"| {'yes' if row['same-accuracy'] else 'no'} |"
        )
    lines += [
        "",
        "**5. Peak memory** (summed PSS of every process of the run)",
        "",
        "| clients | bare loop MiB | flwr simulation MiB | processes |",
        "|---:|---:|---:|---:|",
    ]
    for row in results["overhead"]:
        lines.append(
            f"| {row['clients']} | {row['bare']['peak-pss-bytes'] / MIB:.0f} "
            f"| {row['simulation']['peak-pss-bytes'] / MIB:.0f} "
            f"| {row['simulation']['peak-processes']} |"
        )
    lines += [
        "",
        "**2a. Server share of a simulated round** (10 clients, steady rounds; target <= 0.3%)",
        "",
        "| method | server s | round s | share |",
        "|---|---:|---:|---:|",
    ]
    for row in results["server-fraction"]:
        lines.append(
            f"| {row['method']} | {_fmt(row['server-s'], 4)} | {_fmt(row['round-s'])} "
            f"| {100 * row['fraction']:.2f}% |"
        )
    lines += [
        "",
        "**2b. Server seconds per round against N, D and L** (synthetic replies, no clients)",
        "",
        "| method | N | D | L | server s |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in results["server-cost"]:
        lines.append(
            f"| {row['method']} | {row['clients']} | {row['D']} | {row['L'] or '-'} "
            f"| {_fmt(row['server-s'], 4)} |"
        )
    lines += [
        "",
        "**3. Communication per client and round** (wire = every object Flower serializes for "
        "the message; target wire/parameters <= 1.05)",
        "",
        "| method | parameters B (down / up) | wire B down | wire B up | down ratio | up ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in results["communication"]:
        lines.append(
            f"| {row['method']} | {row['down-parameter-bytes']:.0f} / "
            f"{row['up-parameter-bytes']:.0f} | {row['down-wire-bytes']:.0f} "
            f"| {row['up-wire-bytes']:.0f} | {_fmt(row['down-ratio'])} | {_fmt(row['up-ratio'])} |"
        )
    lines += [
        "",
        "**4. Deployment against simulation** (FedAvg, loopback, TLS + authentication)",
        "",
        "| SuperNodes | deployment round s | simulation round s | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for row in results["deployment"]:
        lines.append(
            f"| {row['supernodes']} | {_fmt(row['deployment']['steady-round-s'])} "
            f"| {_fmt(row['simulation']['steady-round-s'])} | {_fmt(row['ratio'], 1)} |"
        )
    cold = results.get("cold-start")
    if cold:
        lines += [
            "",
            f"ClientApp cold start per message (median of {cold['repeats']}, s, "
            f"`bench.clientapp_cold_start`, {cold['date']}):",
            "",
            "| method | imports | data | total |",
            "|---|---:|---:|---:|",
        ]
        for method, repeats in cold["results"].items():
            median = {k: statistics.median(r[k] for r in repeats) for k in repeats[0]}
            lines.append(
                f"| {method} | {_fmt(median['imports'])} | {_fmt(median['data'])} "
                f"| {_fmt(median['total'])} |"
            )
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any]) -> None:
    """JSON and tables under bench/results/suite, and the block in docs/benchmarks.md."""
    mode = results["mode"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"results-{mode}.json").write_text(json.dumps(results, indent=2))
    text = tables(results)
    (RESULTS / f"tables-{mode}.md").write_text(text)
    begin, end = f"<!-- bench:{mode}:begin -->", f"<!-- bench:{mode}:end -->"
    if DOC.exists():
        doc = DOC.read_text()
        if begin in doc and end in doc:
            head, rest = doc.split(begin, 1)
            _, tail = rest.split(end, 1)
            DOC.write_text(f"{head}{begin}\n{text}{end}{tail}")
    print(text)


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="CPU, a few minutes (default)")
    group.add_argument("--full", action="store_true", help="larger grid, for a GPU machine")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--tables-only", type=Path, help="re-render the tables of an existing results JSON"
    )
    args = parser.parse_args(argv)
    if args.tables_only:
        write(json.loads(args.tables_only.read_text()))
        return 0
    write(run_suite("full" if args.full else "quick", parse_overrides(args.set)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
