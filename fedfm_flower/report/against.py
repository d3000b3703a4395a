"""Each method against itself in another set of runs (tuned against untuned, a change against
the code before it): per (setup, method), the paired difference over matched (seed, client).

The two sets are matched by setup name, method label, seed and client id; a (setup, method)
found in only one set is left out. The test is the table's (``tables``): a two-sided paired
t-test over the units both sets evaluated, in the metric's units x ``scale``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedfm_flower.report.runs import RunResult
from fedfm_flower.report.tables import ALPHA, by_cell, paired_units
from fedfm_flower.statistics import PairedTest, paired_test


@dataclass(frozen=True)
class Against:
    """One (setup, method) of both sets: their means over seeds and the paired test."""

    setup: str
    label: str
    seeds: tuple[int, ...]  # seeds both sets ran
    mean: float  # this set, over ``seeds``
    other_mean: float
    test: PairedTest | None  # this - other; None below two units

    @property
    def verdict(self) -> str:
        """'higher', 'lower' (p < ALPHA) or 'n.s.'."""
        if self.test is None or not self.test.significant(ALPHA):
            return "n.s."
        return "higher" if self.test.mean_difference > 0 else "lower"


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
        a: list[float] = []
        b: list[float] = []
        for seed in seeds:
            x, y = paired_units(by_seed[seed], theirs[key][seed])
            a += [scale * v for v in x]
            b += [scale * v for v in y]
        mean = statistics.fmean(scale * by_seed[s].final_mean for s in seeds)
        other = statistics.fmean(scale * theirs[key][s].final_mean for s in seeds)
        test = paired_test(a, b) if len(a) >= 2 else None
        rows.append(Against(key[0], key[1], seeds, mean, other, test))
    return rows


def markdown_against(rows: Sequence[Against], name: str) -> str:
    """The section of the report: one row per (setup, method)."""
    lines = [
        f"## Against {name}",
        "",
        f"Each method against its own runs in **{name}**, paired over (seed, client); Δ = "
        f"this - {name}; higher/lower: p < {ALPHA}.",
        "",
        f"| setup | method | seeds | this | {name} | Δ | 95% CI of Δ | units | p | verdict |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        if row.test is None:
            delta = interval = units = p = "-"
        else:
            t = row.test
            delta = f"{t.mean_difference:+.2f}"
            interval = (
                f"[{t.mean_difference - t.ci_half_width:+.2f}, "
                f"{t.mean_difference + t.ci_half_width:+.2f}]"
            )
            units, p = str(t.n), f"{t.p_value:.3g}"
        seeds = ", ".join(map(str, row.seeds))
        lines.append(
            f"| {row.setup} | {row.label} | {seeds} | {row.mean:.2f} | {row.other_mean:.2f} | "
            f"{delta} | {interval} | {units} | {p} | {row.verdict} |"
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
                "units": None if row.test is None else row.test.n,
                "p-value": None if row.test is None else row.test.p_value,
                "verdict": row.verdict,
            }
            for row in rows
        ],
    }
