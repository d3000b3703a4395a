"""Each method against itself in another set of runs (tuned against untuned, a change against
the code before it): per (setup, method), the paired difference over the seeds both ran.

The two sets are matched by setup name, method label, seed and client id; a (setup, method)
found in only one set is left out. The test is the table's (``tables.compare``): a two-sided
paired t-test over the seeds both sets ran, each seed's mean over the clients both evaluated,
in the metric's units x ``scale``; the (seed, client) units pooled are shown beside it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedfm_flower.report.runs import RunResult
from fedfm_flower.report.tables import (
    ALPHA,
    Comparison,
    by_cell,
    compare,
    interval_text,
    pooled_text,
)
from fedfm_flower.study.statistics import PairedTest


@dataclass(frozen=True)
class Against:
    """One (setup, method) of both sets: their means over seeds and the paired comparison."""

    setup: str
    label: str
    seeds: tuple[int, ...]  # seeds both sets ran
    mean: float  # this set, over ``seeds``
    other_mean: float
    comparison: Comparison  # this - other

    @property
    def test(self) -> PairedTest | None:
        """The verdict's test, over seeds (None below two seeds)."""
        return self.comparison.test

    @property
    def verdict(self) -> str:
        """'higher', 'lower' (p < ALPHA over seeds) or 'n.s.'."""
        return self.comparison.verdict


def build_against(
    runs: Sequence[RunResult], others: Sequence[RunResult], scale: float = 100.0
) -> list[Against]:
    """Every (setup, method) present in both sets, in the order of ``runs``."""
    mine, theirs = by_cell(runs), by_cell(others)
    rows = []
    for key, by_seed in mine.items():
        if key not in theirs:
            continue
        seeds = tuple(sorted(set(by_seed) & set(theirs[key])))
        if not seeds:
            continue
        mean = statistics.fmean(scale * by_seed[s].final_mean for s in seeds)
        other = statistics.fmean(scale * theirs[key][s].final_mean for s in seeds)
        rows.append(Against(key[0], key[1], seeds, mean, other, compare(by_seed, theirs[key])))
    return rows


def markdown_against(rows: Sequence[Against], name: str) -> str:
    """The section of the report: one row per (setup, method)."""
    lines = [
        f"## Against {name}",
        "",
        f"Each method against its own runs in **{name}**, paired over the seeds both ran (each "
        f"seed's mean over the clients both evaluated); Δ = this - {name}; higher/lower: "
        f"p < {ALPHA}. The (seed, client) units pooled describe the difference and decide "
        "nothing.",
        "",
        f"| setup | method | seeds | this | {name} | Δ | 95% CI of Δ (seeds) | p | verdict | "
        "units pooled: 95% CI, p |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        delta = interval = p = "-"
        if row.test is not None:
            t = row.test
            delta, interval, p = f"{t.mean_difference:+.2f}", interval_text(t), f"{t.p_value:.3g}"
        units = pooled_text(row.comparison.pooled)
        seeds = ", ".join(map(str, row.seeds))
        lines.append(
            f"| {row.setup} | {row.label} | {seeds} | {row.mean:.2f} | {row.other_mean:.2f} | "
            f"{delta} | {interval} | {p} | {row.verdict} | {units} |"
        )
    return "\n".join(lines)


def against_numbers(rows: Sequence[Against], name: str) -> dict[str, Any]:
    """The section's numbers for report.json."""
    return {
        "name": name,
        "rows": [
            {
                "setup": row.setup,
                "method": row.label,
                "seeds": list(row.seeds),
                "mean": row.mean,
                "other-mean": row.other_mean,
                "mean-difference": None if row.test is None else row.test.mean_difference,
                "ci95": None if row.test is None else row.test.ci_half_width,
                "test": "seeds",
                "pooled-units": None
                if row.comparison.pooled is None
                else {
                    "n": row.comparison.pooled.n,
                    "ci95": row.comparison.pooled.ci_half_width,
                    "p-value": row.comparison.pooled.p_value,
                },
                "p-value": None if row.test is None else row.test.p_value,
                "verdict": row.verdict,
            }
            for row in rows
        ],
    }
