"""Compare methods on the offline setups over several seeds; write JSON and a markdown table.

    python -m bench.compare_methods --methods fedrep fedavg pfedseq pfedseq:variant-b \
        --seeds 0 1 2 --setups digits-label-skew digits-feature-skew --rounds 20

Each run is the real ServerApp loop and ClientApp in one process (``server_apps.inprocess``),
with the settings of ``configs/<method>/<setup>.toml``; ``method:variant`` overlays
``configs/<method>/<variant>.toml`` on them (the paper's ablations), and ``--set`` overlays
single keys on every run (name such runs with ``--tag``). The table reports the final mean
per-client test accuracy, mean +- std over seeds, and the bytes each client sends per round.

Every cell's config is validated before the first run (a bad one: exit status 2, nothing run).
A run that fails is reported and skipped, the other cells still run, their results are written,
and the exit status is 1; rerunning repeats only the failed cells.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fedfm_flower.config.overrides import parse_overrides
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.study import cells, sweep

ROOT = Path(__file__).resolve().parent.parent


def cell_config(
    method: str,
    setup: str,
    seed: int,
    rounds: int,
    clients: int,
    out: Path,
    overrides: dict | None = None,
    tag: str = "",
) -> dict[str, Any]:
    """The run config of one (method, setup, seed) cell of the grid
    (``fedfm_flower.study.sweep``)."""
    fixed = {"num-server-rounds": rounds, "num-clients": clients}
    return sweep.cell_config(method, setup, seed, out, {**(overrides or {}), **fixed}, tag)


def run_one(config: dict[str, Any], method: str, setup: str) -> dict:
    """One in-process experiment of a ``cell_config`` (reused when finished, resumed when
    interrupted); returns its summary plus the method, the setup (with its tag) and the bytes
    each client sends per round."""
    cell = cells.Cell(method, setup, int(config["seed"]), config)
    summary = cells.run_cell(cell)
    records = RunDirectory(cell.run_dir).rounds()
    up = statistics.fmean(r["bytes-up-train"] / max(r["clients-reported"], 1) for r in records)
    return {
        **summary,
        "method": method,
        "setup": setup,
        "bytes-up-per-client-round": up,
        "curve": [r.get("test-accuracy-mean") for r in records],
    }


def table(results: list[dict], methods: list[str], setups: list[str]) -> str:
    """Markdown table: rows are methods, columns setups, cells mean +- std over seeds."""
    lines = [
        "| method | " + " | ".join(setups) + " | bytes up / client / round |",
        "|---|" + "---|" * len(setups) + "---|",
    ]
    for method in methods:
        cells = []
        for setup in setups:
            accs = [
                100 * r["final-test-accuracy-mean"]
                for r in results
                if r["method"] == method and r["setup"] == setup
            ]
            std = statistics.pstdev(accs) if len(accs) > 1 else 0.0
            cells.append(
                f"{statistics.fmean(accs):.2f} ± {std:.2f} (n={len(accs)})" if accs else "—"
            )
        ups = [r["bytes-up-per-client-round"] for r in results if r["method"] == method]
        cells.append(f"{statistics.fmean(ups):,.0f}" if ups else "—")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the grid of experiments and print/write the results; returns the exit status."""
    parser = argparse.ArgumentParser(description="compare methods on the offline setups")
    parser.add_argument("--methods", nargs="+", default=["fedrep", "fedavg"])
    parser.add_argument("--setups", nargs="+", default=["digits-label-skew", "digits-feature-skew"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "compare")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run-config overrides for every run, e.g. dirichlet-alpha=0.1",
    )
    parser.add_argument("--tag", default="", help="suffix for setup names when using --set")
    args = parser.parse_args(argv)
    from fedfm_flower.records.logs import configure_logging

    configure_logging()
    try:
        overrides = parse_overrides(args.set)
        grid = {
            (setup, method, seed): cell_config(
                method, setup, seed, args.rounds, args.clients, args.out, overrides, args.tag
            )
            for setup in args.setups
            for method in args.methods
            for seed in args.seeds
        }
        sweep.check_configs(list(grid.values()))
    except (ValueError, OSError) as err:  # ConfigError, a missing configs/<method>/<setup>.toml
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results, failures, started = [], [], time.perf_counter()
    for (setup, method, seed), config in grid.items():
        try:
            result = run_one(config, method, setup + args.tag)
        except Exception as err:  # noqa: BLE001 - report it, run the other cells
            failures.append(
                {"method": method, "setup": setup, "seed": seed, "error": f"{err}"[:2000]}
            )
            print(f"FAILED {method} {setup} seed {seed}: {err}", file=sys.stderr, flush=True)
            continue
        results.append(result)
        print(
            f"{method:10s} {setup:22s} seed {seed}: {100 * result['final-test-accuracy-mean']:.2f}",
            flush=True,
        )
    payload = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
        "failures": failures,
        "seconds": time.perf_counter() - started,
    }
    name = f"results{args.tag}"
    (args.out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    markdown = table(results, args.methods, [s + args.tag for s in args.setups])
    (args.out / f"table{args.tag}.md").write_text(markdown + "\n")
    print(markdown)
    if failures:
        print(f"error: {len(failures)} of {len(grid)} runs failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
