"""The benchmark suite: what the framework costs over the bare compute, and how it grows.

    python -m bench.suite --quick      # CPU, offline setup, ~10 minutes on 2 cores
    python -m bench.suite --full       # more clients, ranks, L and SuperNodes, plus cold start
    python -m bench.suite --gpu        # a GPU: ViT-S/B at 224 px, clients sharing the GPU
    python -m bench.suite --gpu --sections server-cost --merge   # one section, keep the rest

Sections (each also runs alone, see its module):

1. ``simulation_overhead``: the same FedAvg experiment as a bare PyTorch loop and through
   ``flwr run`` simulation, at 10 and 100 clients; also the peak memory of both (item 5).
2. ``server_cost``: each strategy's own work per round against N, D and L, plus its fraction of
   a simulated round (``server-seconds`` / ``round-seconds`` from ``flwr run`` simulations).
3. ``communication``: bytes on the wire per client and round against the parameters' bytes.
4. ``deployment_rounds``: loopback deployment with 2 (and 4) SuperNodes against simulation;
   the per-message ClientApp cold start is ``bench.clientapp_cold_start`` (run in ``--full``).

``--gpu`` runs sections 1, 2 and 5 with timm's ViT-S/16 and ViT-B/16 (random weights, 224 px
digits) at GPU shares 1 (one client at a time, like the bare loop) and 0.25 (four at once).

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
import traceback
from pathlib import Path
from typing import Any

from bench import communication, deployment_rounds, server_cost, simulation_overhead
from fedfm_flower.config.overrides import parse_overrides
from fedfm_flower.records.durable import atomic_write_text
from fedfm_flower.simulation.processes import exit_on_sigterm

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "suite"
DOC = ROOT / "docs" / "benchmarks.md"
MIB = 1024 * 1024

SECTIONS = ("overhead", "fraction", "server-cost", "communication", "deployment", "cold-start")
VIT_S, VIT_B = "vit_small_patch16_224", "vit_base_patch16_224"

MODES: dict[str, dict[str, Any]] = {
    "quick": {
        "overhead": [("tiny-vit", [10, 100])],
        "gpu-fractions": [0.0],
        "rounds": 4,
        "fraction-backbone": "tiny-vit",
        "server-backbone": "tiny-vit",
        "server-clients": [10, 100],
        "ranks": [4, 16],
        "seq-lens": [5, 10],
        "fraction-clients": 10,
        "fraction-methods": ["fedrep", "pfedseq", "pfedpg"],
        "supernodes": [2],
        "deploy-rounds": 4,
        "sections": ("overhead", "fraction", "server-cost", "communication", "deployment"),
    },
    "full": {
        "overhead": [("tiny-vit", [10, 100])],
        "gpu-fractions": [0.0],
        "rounds": 6,
        "fraction-backbone": "tiny-vit",
        "server-backbone": "tiny-vit",
        "server-clients": [10, 100, 1000],
        "ranks": [4, 16, 64],
        "seq-lens": [5, 10, 20],
        "fraction-clients": 10,
        "fraction-methods": ["fedrep", "pfedseq", "pfedpg"],
        "supernodes": [2, 4],
        "deploy-rounds": 4,
        "sections": SECTIONS,
    },
    # A GPU machine: ViT-S/B (random weights, 224 px) with several clients sharing the GPU.
    "gpu": {
        "overhead": [(VIT_S, [10, 100]), (VIT_B, [10])],
        "gpu-fractions": [1.0, 0.25],
        "rounds": 4,
        "fraction-backbone": VIT_S,
        "server-backbone": VIT_B,
        "server-clients": [10, 100],
        "ranks": [4, 16],
        "seq-lens": [5, 10],
        "fraction-clients": 10,
        "fraction-methods": ["fedrep", "pfedseq", "pfedpg"],
        "sections": ("overhead", "fraction", "server-cost"),
    },
}


def backbone_config(backbone: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Run-config keys for a benchmark backbone: timm ViTs with random weights, at 224 px
    unless ``overrides`` set ``image-size`` (a small size runs the same code on a CPU).

    Timing does not depend on the weights, and random ones need neither the Hub nor a file.
    """
    if backbone == "tiny-vit":
        return {}
    return {
        "backbone": backbone,
        "pretrained": False,
        "image-size": overrides.get("image-size", 224),
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
    methods: list[str],
    rounds: int,
    config: dict,
    workdir: Path,
    overhead: list[dict],
    gpu_fraction: float,
    num_clients: int = 10,
) -> list[dict]:
    """Server seconds over round seconds (steady rounds) of simulations with ``num_clients``.

    FedAvg's run is taken from the overhead section when it ran the same setup. pFedSeq runs
    with a warm-up of 1 round, so that every steady round has both the learner update and the
    calibrations (with the default warm-up of 5, a 4-round run would never infer).
    """
    backbone = config.get("backbone", "tiny-vit")
    cpus = simulation_overhead.usable_cpus()
    _, client_cpus = simulation_overhead.share_resources(gpu_fraction, cpus)
    same_setup = [
        row["simulation"]
        for row in overhead
        if row["clients"] == num_clients
        and row.get("backbone", "tiny-vit") == backbone
        and row.get("gpu-fraction", 0.0) == gpu_fraction
    ]
    runs = {"fedavg": same_setup[0]} if same_setup else {}
    for method in ([] if runs else ["fedavg"]) + methods:
        method_config = {**config, "method": method}
        if method == "pfedseq":
            method_config["pfedseq-warmup-rounds"] = 1
        runs[method] = simulation_overhead.run_flower_simulation(
            num_clients,
            rounds,
            client_cpus,
            method_config,
            workdir,
            f"{method}-{num_clients}",
            gpu_fraction,
        )
    rows = []
    for method, run in runs.items():
        server = simulation_overhead.steady(run["server-s"])
        round_s = run["steady-round-s"]
        rows.append(
            {
                "method": method,
                "backbone": backbone,
                "clients": num_clients,
                "gpu-fraction": gpu_fraction,
                "server-s": server,
                "round-s": round_s,
                "fraction": server / round_s,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run_suite(
    mode: str,
    overrides: dict[str, Any],
    sections: tuple[str, ...],
    workdir: Path | None = None,
) -> dict[str, Any]:
    """The chosen sections of a mode; their results (runs under ``workdir``, by default
    ``bench/work/suite-<mode>``).

    A section that fails is recorded under ``failed`` (its error) and the others still run:
    half an hour of measurements is not lost to the last section.
    """
    plan = MODES[mode]
    workdir = workdir or ROOT / "bench" / "work" / f"suite-{mode}"
    config = {"seed": 0, "num-server-rounds": plan["rounds"], **overrides}
    started = time.perf_counter()
    results: dict[str, Any] = {
        "mode": mode,
        "machine": machine(),
        "config": config,
        "sections": list(sections),
    }

    def overhead() -> None:
        rows: list[dict[str, Any]] = []
        for backbone, clients in plan["overhead"]:
            rows += simulation_overhead.measure(
                clients,
                plan["rounds"],
                {**config, **backbone_config(backbone, overrides)},
                workdir / "overhead" / backbone,
                tuple(plan["gpu-fractions"]),
            )
        results["overhead"] = rows

    def fraction() -> None:
        backbone = plan["fraction-backbone"]
        results["server-fraction"] = server_fractions(
            plan["fraction-methods"],
            plan["rounds"],
            {**config, **backbone_config(backbone, overrides)},
            workdir / "fraction" / backbone,
            results.get("overhead", []),
            plan["gpu-fractions"][-1],
            plan["fraction-clients"],
        )

    def cost() -> None:
        results["server-cost"] = server_cost.measure(
            list(server_cost.METHODS),
            plan["server-clients"],
            plan["ranks"],
            plan["seq-lens"],
            {**overrides, **backbone_config(plan["server-backbone"], overrides)},
        )

    def wire() -> None:
        results["communication"] = communication.measure(list(communication.METHODS), overrides)

    def deployment() -> None:
        results["deployment"] = deployment_rounds.measure(
            plan["supernodes"], plan["deploy-rounds"], {"seed": 0, **overrides}, workdir / "deploy"
        )

    def cold_start() -> None:
        subprocess.run([sys.executable, "-m", "bench.clientapp_cold_start"], cwd=ROOT, check=True)

    steps = {
        "overhead": overhead,
        "fraction": fraction,
        "server-cost": cost,
        "communication": wire,
        "deployment": deployment,
        "cold-start": cold_start,
    }
    for name, step in steps.items():
        if name not in sections:
            continue
        try:
            step()
        except Exception as err:  # noqa: BLE001 - recorded, reported, exit status 1
            traceback.print_exc()
            results.setdefault("failed", {})[name] = f"{type(err).__name__}: {err}"
    cold = ROOT / "bench" / "results" / "clientapp_cold_start" / "results.json"
    if "deployment" in sections and cold.exists():
        results["cold-start"] = json.loads(cold.read_text())
    results["seconds"] = time.perf_counter() - started
    return results


def merge_results(earlier: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``earlier`` with the sections ``new`` measured replaced; minutes add up."""
    merged = {**earlier, **new}
    merged["seconds"] = earlier.get("seconds", 0.0) + new["seconds"]
    rerun = set(new.get("sections", ()))
    failed = {k: v for k, v in earlier.get("failed", {}).items() if k not in rerun}
    failed.update(new.get("failed", {}))
    merged.pop("failed", None)
    if failed:
        merged["failed"] = failed
    merged["sections"] = sorted(set(earlier.get("sections", ())) | rerun)
    return merged


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.0f}"


def _gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 1024 / MIB:.2f}"


def _accuracy(row: dict[str, Any]) -> str:
    if row["same-accuracy"]:
        return "yes"
    return f"differs by {row.get('accuracy-difference', float('nan')):.4f}"


def overhead_tables(rows: list[dict[str, Any]]) -> list[str]:
    """Sections 1 and 5; the backbone and GPU-share columns only when a GPU was used."""
    on_gpu = any(row.get("gpu-fraction", 0.0) > 0 for row in rows)
    setup = "| backbone | GPU share | clients at once " if on_gpu else ""
    setup_rule = "|---|---:|---:" if on_gpu else ""

    def setup_cells(row: dict[str, Any]) -> str:
        if not on_gpu:
            return ""
        return f"| {row['backbone']} | {row['gpu-fraction']:g} | {row['parallel-clients']} "

    lines = [
        "**1. Simulation overhead** (FedAvg; steady = median of rounds 2..R-1; launch = `flwr run`"
        " until round 1 starts)",
        "",
        f"{setup}| clients | bare round s | flwr round s | ratio (target <= 1.10) "
        "| first-round extra s | launch s | same accuracy |",
        f"{setup_rule}|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"{setup_cells(row)}| {row['clients']} | {_fmt(row['bare']['steady-round-s'])} "
            f"| {_fmt(row['simulation']['steady-round-s'])} | {_fmt(row['steady-ratio'])} "
            f"| {_fmt(row['first-round-extra-s'])} | {_fmt(row['simulation']['launch-s'], 1)} "
            f"| {_accuracy(row)} |"
        )
    lines += [
        "",
        "**5. Peak memory** (host: summed PSS of every process of the run"
        + ("; GPU: device memory in use above the idle baseline" if on_gpu else "")
        + ")",
        "",
        f"{setup}| clients | bare loop MiB | flwr simulation MiB | processes "
        + ("| bare GPU GiB | flwr GPU GiB |" if on_gpu else "|"),
        f"{setup_rule}|---:|---:|---:|---:" + ("|---:|---:|" if on_gpu else "|"),
    ]
    for row in rows:
        bare, flower = row["bare"], row["simulation"]
        gpu = (
            f" {_gib(bare.get('peak-gpu-bytes'))} | {_gib(flower.get('peak-gpu-bytes'))} |"
            if on_gpu
            else ""
        )
        lines.append(
            f"{setup_cells(row)}| {row['clients']} | {_mib(bare['peak-pss-bytes'])} "
            f"| {_mib(flower['peak-pss-bytes'])} | {flower['peak-processes'] or 'n/a'} |{gpu}"
        )
    return lines


def tables(results: dict[str, Any]) -> str:
    """The markdown tables of one suite run (the sections it has)."""
    m = results["machine"]
    lines = [
        f"Measured {m['date']} at commit `{m['commit']}` on {m['cpus']} CPU(s) "
        f"({m['processor']}), GPU: {m['gpu'] or 'none'}, torch {m['torch']}, "
        f"mode `{results['mode']}`, {results['seconds'] / 60:.1f} min in all.",
        "",
    ]
    if results.get("notes"):
        lines += [f"*Notes:* {results['notes']}", ""]
    for name, error in results.get("failed", {}).items():
        lines += [f"**Section `{name}` failed:** {error}", ""]
    if "overhead" in results:
        lines += overhead_tables(results["overhead"])
    if "server-fraction" in results:
        rows = results["server-fraction"]
        backbone = rows[0].get("backbone", "tiny-vit") if rows else "tiny-vit"
        share = rows[0].get("gpu-fraction", 0.0) if rows else 0.0
        clients = rows[0].get("clients", 10) if rows else 10
        lines += [
            "",
            f"**2a. Server share of a simulated round** ({clients} clients, {backbone}"
            + (f", GPU share {share:g}" if share else "")
            + ", steady rounds; target <= 0.3%)",
            "",
            "| method | server s | round s | share |",
            "|---|---:|---:|---:|",
        ]
        for row in rows:
            lines.append(
                f"| {row['method']} | {_fmt(row['server-s'], 4)} | {_fmt(row['round-s'])} "
                f"| {100 * row['fraction']:.2f}% |"
            )
    if "server-cost" in results:
        lines += server_cost_table(results["server-cost"])
    if "communication" in results:
        lines += communication_table(results["communication"])
    if "deployment" in results:
        lines += deployment_table(results["deployment"], results.get("cold-start"))
    return "\n".join(lines) + "\n"


def server_cost_table(rows: list[dict[str, Any]]) -> list[str]:
    """Section 2b."""
    lines = [
        "",
        "**2b. Server seconds per round against N, D and L** (synthetic replies, no clients)",
        "",
        "| method | N | D | L | server s |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['clients']} | {row['D']} | {row['L'] or '-'} "
            f"| {_fmt(row['server-s'], 4)} |"
        )
    return lines


def communication_table(rows: list[dict[str, Any]]) -> list[str]:
    """Section 3."""
    lines = [
        "",
        "**3. Communication per client and round** (wire = every object Flower serializes for "
        "the message; target wire/parameters <= 1.05)",
        "",
        "| method | parameters B (down / up) | wire B down | wire B up | down ratio | up ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {row['down-parameter-bytes']:.0f} / "
            f"{row['up-parameter-bytes']:.0f} | {row['down-wire-bytes']:.0f} "
            f"| {row['up-wire-bytes']:.0f} | {_fmt(row['down-ratio'])} | {_fmt(row['up-ratio'])} |"
        )
    return lines


def deployment_table(rows: list[dict[str, Any]], cold: dict[str, Any] | None) -> list[str]:
    """Section 4 and the cold-start table."""
    lines = [
        "",
        "**4. Deployment against simulation** (FedAvg, loopback, TLS + authentication)",
        "",
        "| SuperNodes | deployment round s | mode | simulation round s | ratio |",
        "|---:|---:|---|---:|---:|",
    ]
    for row in rows:
        deployed = [row[mode.key] for mode in deployment_rounds.MODES.values() if mode.key in row]
        for result in deployed or [row["deployment"]]:
            ratio = result["steady-round-s"] / row["simulation"]["steady-round-s"]
            lines.append(
                f"| {row['supernodes']} | {_fmt(result['steady-round-s'])} "
                f"| {result.get('mode', 'per-message process')} "
                f"| {_fmt(row['simulation']['steady-round-s'])} | {_fmt(ratio, 1)} |"
            )
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
    return lines


def write(results: dict[str, Any]) -> None:
    """JSON and tables under bench/results/suite, and the block in docs/benchmarks.md."""
    mode = results["mode"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    # Atomic (not durable): a kill mid-write must not lose the sections measured earlier.
    text = json.dumps(results, indent=2)
    atomic_write_text(RESULTS / f"results-{mode}.json", text, durable=False)
    text = tables(results)
    atomic_write_text(RESULTS / f"tables-{mode}.md", text, durable=False)
    begin, end = f"<!-- bench:{mode}:begin -->", f"<!-- bench:{mode}:end -->"
    if DOC.exists():
        doc = DOC.read_text()
        if begin in doc and end in doc:
            head, rest = doc.split(begin, 1)
            _, tail = rest.split(end, 1)
            atomic_write_text(DOC, f"{head}{begin}\n{text}{end}{tail}", durable=False)
    print(text)


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="CPU, a few minutes (default)")
    group.add_argument("--full", action="store_true", help="larger grid, 4 SuperNodes, cold start")
    group.add_argument("--gpu", action="store_true", help="ViT-S/B on a GPU, shared by clients")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        help="run only these sections of the mode (default: all of the mode's)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other sections of the mode's existing results JSON",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--tables-only", type=Path, help="re-render the tables of an existing results JSON"
    )
    args = parser.parse_args(argv)
    if args.tables_only:
        write(json.loads(args.tables_only.read_text()))
        return 0
    exit_on_sigterm()  # a stopped suite still stops the run it was measuring
    mode = "full" if args.full else "gpu" if args.gpu else "quick"
    sections = tuple(args.sections or MODES[mode]["sections"])
    results = run_suite(mode, parse_overrides(args.set), sections)
    earlier = RESULTS / f"results-{mode}.json"
    if args.merge and earlier.exists():
        results = merge_results(json.loads(earlier.read_text()), results)
    write(results)
    if results.get("failed"):
        print(f"failed sections: {', '.join(results['failed'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
