"""TAP's replacement counts (its Fig. 3-4): how many clients replaced a pair's parameters per round.

TAP's client reports ``replaced-<pair>`` (1 or 0) for every pair it trained in a round
(``client_apps/tap.py``), stored per client under ``record["train"]`` of ``metrics.jsonl`` as
``train-replaced-<pair>``. A run's count of a pair at a round is the sum of those flags over the
clients that trained that round (a client that did not see the pair adds nothing); only the
federated rounds count (``phase`` "train"; the post-training round replaces nothing). Over the
seeds of a method, the count at a round is the mean over the seeds whose run trained that round,
with their minimum and maximum as the band; the cumulative count (the paper's y axis) is the
running sum of the per-round mean.

Imports inside functions keep ``matplotlib`` out of this module's start-up.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedfm_flower.data.multitask import MULTITASK_TASKS
from fedfm_flower.records import protocol as P
from fedfm_flower.report.figures import _pyplot
from fedfm_flower.report.runs import RunResult

FLAG = P.train_metric("replaced-")  # "train-replaced-<pair>"


def run_counts(path: Path) -> dict[str, dict[int, tuple[int, int]]]:
    """{pair: {federated round: (clients that replaced it, clients that flagged it)}} of a run."""
    records = [json.loads(line) for line in (path / "metrics.jsonl").open() if line.strip()]
    rounds = [r for r in records if r.get("phase", "train") == "train"]
    pairs = sorted(
        {
            k[len(FLAG) :]
            for r in rounds
            for m in (r.get("train") or {}).values()
            for k in m
            if k.startswith(FLAG)
        }
    )
    counts: dict[str, dict[int, tuple[int, int]]] = {pair: {} for pair in pairs}
    for record in rounds:
        clients = (record.get("train") or {}).values()
        for pair in pairs:
            flags = [float(m[FLAG + pair]) for m in clients if FLAG + pair in m]
            counts[pair][int(record["round"])] = (int(round(sum(flags))), len(flags))
    return counts


def replacement_counts(runs: Sequence[RunResult], setup: str) -> dict[str, dict[str, Any]]:
    """{method with flags: {pair: rounds, counts per seed, mean, min, max, cumulative}}."""
    grouped: dict[str, dict[int, dict[str, dict[int, tuple[int, int]]]]] = {}
    for run in runs:
        if run.setup == setup and (counts := run_counts(run.path)):
            grouped.setdefault(run.label, {})[run.seed] = counts
    out: dict[str, dict[str, Any]] = {}
    for label, by_seed in grouped.items():
        pairs = sorted({p for counts in by_seed.values() for p in counts}, key=_pair_order)
        out[label] = {}
        for pair in pairs:
            seeds = sorted(s for s in by_seed if pair in by_seed[s])
            rounds = sorted({r for s in seeds for r in by_seed[s][pair]})
            per_seed = {
                str(s): [by_seed[s][pair][r][0] if r in by_seed[s][pair] else None for r in rounds]
                for s in seeds
            }
            reported = {
                str(s): [by_seed[s][pair][r][1] if r in by_seed[s][pair] else None for r in rounds]
                for s in seeds
            }
            at_round = [
                [v[i] for v in per_seed.values() if v[i] is not None] for i in range(len(rounds))
            ]
            mean = [float(np.mean(v)) for v in at_round]
            out[label][pair] = {
                "rounds": rounds,
                "seeds": seeds,
                "per-seed": per_seed,
                "clients-reporting": reported,
                "mean": mean,
                "min": [float(min(v)) for v in at_round],
                "max": [float(max(v)) for v in at_round],
                "cumulative-mean": [float(x) for x in np.cumsum(mean)],
            }
    return out


def _pair_order(pair: str) -> tuple[int, str]:
    return (MULTITASK_TASKS.index(pair) if pair in MULTITASK_TASKS else len(MULTITASK_TASKS), pair)


def replacement_figure(counts: dict[str, dict[str, Any]], setup: str, path: Path) -> Path:
    """Per method: clients replacing each pair per round (min-max band), cumulative below."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    labels = list(counts)
    figure, axes = plt.subplots(
        2, len(labels), figsize=(4.8 * len(labels), 6.4), squeeze=False, sharex="col"
    )
    for column, label in enumerate(labels):
        top, bottom = axes[0][column], axes[1][column]
        for pair, numbers in counts[label].items():
            rounds = numbers["rounds"]
            (line,) = top.plot(rounds, numbers["mean"], marker="o", markersize=3, label=pair)
            top.fill_between(
                rounds, numbers["min"], numbers["max"], color=line.get_color(), alpha=0.15
            )
            bottom.plot(rounds, numbers["cumulative-mean"], color=line.get_color(), label=pair)
        top.set_title(f"{setup}: {label}, replacements per round", fontsize=9)
        top.set_ylabel("clients replacing (band: min-max over seeds)", fontsize=8)
        bottom.set_ylabel("cumulative replacements (mean)", fontsize=8)
        bottom.set_xlabel("round")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        top.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
