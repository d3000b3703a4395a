"""Bit-for-bit regression of every method on the offline vision setups, against another commit.

    python -m bench.regression run --out /tmp/new.json        # in this tree
    python -m bench.regression compare /tmp/old.json /tmp/new.json

``run`` executes each (method, setup, seed) cell in process (``server_apps.inprocess``) with the
settings of ``configs/<method>/<setup>.toml``, a few rounds and short schedules, and records every
client's exact per-round test metrics and train loss. ``compare`` lists each cell and says whether
its numbers are equal bit for bit (floats compared by ``repr``); its exit status is 1 when any
cell differs or is missing. Run ``run`` in a checkout of the older commit (``git worktree add``)
with the same ``--cache-dir`` so both use the same cached foundation model.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

METHODS = ("local", "fedavg", "fedrep", "fedavg-ft", "fedvpt", "fedvpt-deep", "pfedpg", "pfedseq")
SETUPS = ("digits-label-skew", "digits-feature-skew")
# Short schedules that still reach each method's server-side learner.
OVERRIDES: dict[str, dict[str, Any]] = {
    "pfedseq": {"pfedseq-warmup-rounds": 2, "pfedseq-seq-len": 2, "pfedseq-learner": "mamba"},
}


def run_cells(
    out: Path, seeds: list[int], rounds: int, clients: int, cache_dir: str
) -> dict[str, Any]:
    """Every cell's per-round, per-client numbers, keyed 'method/setup/seed'."""
    from bench.compare_methods import cell_config
    from fedfm_flower.results import RunDirectory
    from server_apps.inprocess import run_in_process

    cells: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fedfm-regression-") as tmp:
        for method in METHODS:
            for setup in SETUPS:
                for seed in seeds:
                    config = cell_config(method, setup, seed, rounds, clients, Path(tmp))
                    config.update(OVERRIDES.get(method, {}))
                    config.update({"cache-dir": cache_dir, "local-steps": 3, "eval-every": 1})
                    run_in_process(config, clients)
                    records = RunDirectory(Path(tmp) / "runs" / config["run-name"]).rounds()
                    key = f"{method}/{setup}/{seed}"
                    cells[key] = [
                        {
                            "train": {c: repr(m["train-loss"]) for c, m in r["train"].items()},
                            "evaluate": {
                                c: {k: repr(v) for k, v in sorted(m.items())}
                                for c, m in r.get("evaluate", {}).items()
                            },
                        }
                        for r in records
                    ]
                    print(f"[regression] {key}: {len(records)} rounds", flush=True)
                    out.write_text(json.dumps(cells, indent=1))
    return cells


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str]]:
    """(cell, 'identical' | what differs) for every cell of ``old``."""
    rows = []
    for key, rounds in old.items():
        if key not in new:
            rows.append((key, "missing"))
            continue
        diffs = []
        for index, (a, b) in enumerate(zip(rounds, new[key], strict=False)):
            for client, metrics in a["evaluate"].items():
                theirs = b["evaluate"].get(client, {})
                for name, value in metrics.items():
                    if theirs.get(name) != value:
                        diffs.append(f"round {index + 1} client {client} {name}")
            if a["train"] != b["train"]:
                diffs.append(f"round {index + 1} train loss")
        if len(rounds) != len(new[key]):
            diffs.append(f"{len(rounds)} vs {len(new[key])} rounds")
        rows.append((key, "identical" if not diffs else "; ".join(diffs[:3])))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: ``run`` or ``compare``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    run.add_argument("--rounds", type=int, default=4)
    run.add_argument("--clients", type=int, default=4)
    run.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "fedfm-regcache"))
    cmp = sub.add_parser("compare")
    cmp.add_argument("old", type=Path)
    cmp.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        run_cells(args.out, args.seeds, args.rounds, args.clients, args.cache_dir)
        return 0
    rows = compare(json.loads(args.old.read_text()), json.loads(args.new.read_text()))
    print("| method | setup | seed | per-client metrics |\n|---|---|---|---|")
    for key, verdict in rows:
        method, setup, seed = key.split("/")
        print(f"| {method} | {setup} | {seed} | {verdict} |")
    return 0 if all(v == "identical" for _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
