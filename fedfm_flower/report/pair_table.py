"""TAP's per-pair tables (its Tables 1-3) with Welch's t-test against a reference (its Table 17).

For the runs of a setup whose final evaluation has per-pair metrics (``test-<metric>-<pair>``,
``metric`` one of ``PAIR_METRICS``, ``pair`` one of ``MULTITASK_TASKS``: the ``multitask``
task's evaluation, ``fedfm_flower.tasks.multitask``), the table has one row per (metric, pair)
present, pairs in ``MULTITASK_TASKS`` order, and one column per method (the reference first).

A seed's value of a row is the mean over that run's clients that hold the pair (those whose
final evaluation reports the key); a cell is the mean over seeds with the half-width of its
Student-t 95% interval (``fedfm_flower.study.statistics.mean_ci``), as in the main table: x 100 for
accuracy, BERTScore F1 and METEOR, raw for MSE (lower is better). A seed whose run has no
client of the pair does not count in the cell.

Each other method is compared with the reference, per row, by Welch's t-test (unequal variances,
``scipy.stats.ttest_ind(..., equal_var=False)``, two-sided) over the per-(seed, client) values
of the two methods, as the paper's Appendix C.5 does: ``↑`` when p < ``ALPHA`` and the method's
mean is better (higher; lower for MSE), ``↓`` when p < ``ALPHA`` and it is worse, no mark
otherwise. The test needs two values on each side; two constant samples give scipy's p = 0
when they differ (t infinite) and p = NaN, no mark, when they are equal. Welch's test does not
pair clients, and it counts the clients of one seed as independent, which they are not (they
share a federation and a training run). So beside it each cell has the main table's test
(``tables``): a paired t-test over the seeds both ran of the seeds' values
(``PairCell.over_seeds``); the marks are the paper's protocol, and a difference that test does
not find is not one 3 seeds settle.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scipy import stats

from fedfm_flower.data.multitask import MULTITASK_TASKS
from fedfm_flower.records import protocol as P
from fedfm_flower.report.runs import RunResult
from fedfm_flower.study.statistics import PairedTest, mean_ci, paired_test

ALPHA = 0.05
PAIR_METRICS: tuple[str, ...] = ("accuracy", "mse", "bertscore", "meteor")
LOWER_IS_BETTER = frozenset({"mse"})
RAW = frozenset({"mse"})  # shown raw with 4 decimals; the others x 100 with 2


@dataclass(frozen=True)
class WelchTest:
    """Welch's two-sided t-test of a method's per-(seed, client) values against the reference's."""

    n: int  # the method's units
    n_reference: int
    mean_difference: float  # method minus reference, in the row's units
    statistic: float
    p_value: float  # NaN where undefined (two equal constant samples)


@dataclass(frozen=True)
class PairCell:
    """One (row, method) entry: mean over seeds ± 95% half-width, and the test if any."""

    seeds: tuple[int, ...]
    per_seed: tuple[float, ...]  # the seeds' values, scaled
    mean: float
    ci: float
    units: tuple[float, ...]  # per-(seed, client) values, scaled
    versus: WelchTest | None  # None for the reference, or too few units on either side
    mark: str  # "↑", "↓" or ""
    over_seeds: PairedTest | None = None  # paired over the seeds both ran; None below 2


@dataclass(frozen=True)
class PairTable:
    """One setup's table: rows (metric, pair), method columns, {row: {method: PairCell}}."""

    setup: str
    reference: str
    rows: tuple[tuple[str, str], ...]
    labels: tuple[str, ...]
    cells: dict[tuple[str, str], dict[str, PairCell]]

    @property
    def has_reference(self) -> bool:
        """Whether the setup has runs of the reference method (and so any tests)."""
        return self.reference in self.labels


def row_name(metric: str, pair: str) -> str:
    """A row's name: ``<metric> <pair>``."""
    return f"{metric} {pair}"


def scale_of(metric: str) -> float:
    """The factor a metric's values are shown in: 1 for MSE, 100 (percent) otherwise."""
    return 1.0 if metric in RAW else 100.0


def pair_keys(run: RunResult) -> set[tuple[str, str]]:
    """The (metric, pair) rows present in any client's final evaluation of ``run``."""
    present = {k for m in run.final_metrics.values() for k in m}
    return {
        (metric, pair)
        for metric in PAIR_METRICS
        for pair in MULTITASK_TASKS
        if P.test_metric(f"{metric}-{pair}") in present
    }


def client_values(run: RunResult, metric: str, pair: str) -> list[float]:
    """The run's final per-client values of ``metric`` on ``pair`` (clients holding it), by id."""
    key = P.test_metric(f"{metric}-{pair}")
    return [
        run.final_metrics[c][key] for c in sorted(run.final_metrics) if key in run.final_metrics[c]
    ]


def welch_test(a: Sequence[float], b: Sequence[float]) -> WelchTest | None:
    """Welch's two-sided t-test of ``a`` against ``b``; None with fewer than 2 values in either."""
    if len(a) < 2 or len(b) < 2:
        return None
    result = stats.ttest_ind(a, b, equal_var=False)
    return WelchTest(
        len(a),
        len(b),
        statistics.fmean(a) - statistics.fmean(b),
        float(result.statistic),
        float(result.pvalue),
    )


def mark_of(test: WelchTest | None, metric: str, alpha: float = ALPHA) -> str:
    """'↑' significantly better than the reference, '↓' significantly worse, '' neither."""
    if test is None or not test.p_value < alpha:  # NaN compares False
        return ""
    better = test.mean_difference < 0 if metric in LOWER_IS_BETTER else test.mean_difference > 0
    return "↑" if better else "↓"


def build_pair_table(runs: Sequence[RunResult], setup: str, reference: str) -> PairTable | None:
    """The per-pair table of ``setup`` over its runs with per-pair metrics; None when none."""
    chosen = [r for r in runs if r.setup == setup and pair_keys(r)]
    if not chosen:
        return None
    present = set().union(*(pair_keys(r) for r in chosen))
    rows = tuple(
        (metric, pair)
        for pair in MULTITASK_TASKS
        for metric in PAIR_METRICS
        if (metric, pair) in present
    )
    grouped: dict[str, dict[int, RunResult]] = {}
    for run in sorted(chosen, key=lambda r: r.label != reference):  # the reference first
        grouped.setdefault(run.label, {})[run.seed] = run
    cells: dict[tuple[str, str], dict[str, PairCell]] = {}
    for metric, pair in rows:
        scale = scale_of(metric)
        units: dict[str, dict[int, list[float]]] = {}
        for label, by_seed in grouped.items():
            per_seed = {s: client_values(by_seed[s], metric, pair) for s in sorted(by_seed)}
            units[label] = {s: [scale * v for v in vs] for s, vs in per_seed.items() if vs}
        base = [v for vs in units.get(reference, {}).values() for v in vs]
        row: dict[str, PairCell] = {}
        for label, by_seed_units in units.items():
            if not by_seed_units:
                continue
            seeds = tuple(by_seed_units)
            per_seed = tuple(statistics.fmean(by_seed_units[s]) for s in seeds)
            mean, ci = mean_ci(per_seed)
            flat = tuple(v for s in seeds for v in by_seed_units[s])
            versus = None if label == reference or not base else welch_test(flat, base)
            over_seeds = None
            if label != reference:
                mine = dict(zip(seeds, per_seed, strict=True))
                theirs = {s: statistics.fmean(v) for s, v in units.get(reference, {}).items()}
                shared = sorted(set(mine) & set(theirs))
                if len(shared) >= 2:
                    over_seeds = paired_test([mine[s] for s in shared], [theirs[s] for s in shared])
            mark = mark_of(versus, metric)
            row[label] = PairCell(seeds, per_seed, mean, ci, flat, versus, mark, over_seeds)
        cells[(metric, pair)] = row
    return PairTable(setup, reference, rows, tuple(grouped), cells)


def _value(metric: str, value: float) -> str:
    return f"{value:.4f}" if metric in RAW else f"{value:.2f}"


def _label(metric: str, pair: str) -> str:
    direction = "lower is better" if metric in LOWER_IS_BETTER else "higher is better"
    return f"{row_name(metric, pair)} ({direction})"


def markdown_pair_table(table: PairTable) -> str:
    """The table in Markdown: heading, caption, the cells, then the p-values of the tests."""
    names = [
        f"{label} (reference)" if label == table.reference else label for label in table.labels
    ]
    lines = [
        f"### {table.setup}: final metrics per modality-task pair (TAP's Tables 1-3)",
        "",
        "Rows: `<metric> <pair>`; accuracy, BERTScore F1 and METEOR x 100, MSE raw (**MSE: "
        "lower is better**). Cells: mean over seeds of each seed's mean over the clients that "
        "hold the pair, ± 95% CI half-width (Student t over seeds). ↑/↓: **Welch's t-test** "
        "(unequal variances, two-sided) over the (seed, client) values against "
        f"**{table.reference}** finds the method better/worse at p < {ALPHA} (for MSE, better "
        "= lower); no mark: no significant difference (or too few values to test).",
        "",
        "| metric pair | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for metric, pair in table.rows:
        row = table.cells[(metric, pair)]
        values = [
            "—"
            if (cell := row.get(label)) is None
            else f"{_value(metric, cell.mean)} ± {_value(metric, cell.ci)}{cell.mark}"
            for label in table.labels
        ]
        lines.append(f"| {_label(metric, pair)} | " + " | ".join(values) + " |")
    others = [label for label in table.labels if label != table.reference]
    if not table.has_reference:
        lines += ["", f"No finished run of **{table.reference}** with these metrics: no tests."]
    elif others:
        lines += [
            "",
            f"Welch's t-test against **{table.reference}**: p-value, (the method's vs the "
            f"reference's number of (seed, client) values), ↑/↓ at p < {ALPHA}; then the "
            "paired t-test over the seeds both ran (`seeds:` p, and its mark), the test of the "
            "main table, which does not count one seed's clients as independent.",
            "",
            "| metric pair | " + " | ".join(others) + " |",
            "|---|" + "---:|" * len(others),
        ]
        for metric, pair in table.rows:
            row = table.cells[(metric, pair)]
            values = []
            for label in others:
                test = None if (cell := row.get(label)) is None else cell.versus
                text = "—"
                if test is not None:
                    text = f"{_p_text(test.p_value)} ({test.n} vs {test.n_reference}){cell.mark}"
                if cell is not None and cell.over_seeds is not None:
                    seeds_mark = seed_mark(cell.over_seeds, metric)
                    text += f"; seeds: {_p_text(cell.over_seeds.p_value)}{seeds_mark}"
                values.append(text)
            lines.append(f"| {row_name(metric, pair)} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def seed_mark(test: PairedTest, metric: str, alpha: float = ALPHA) -> str:
    """'↑' / '↓' where the test over seeds finds the method better / worse, '' neither."""
    if not test.p_value < alpha:
        return ""
    lower = metric in LOWER_IS_BETTER
    return "↑" if (test.mean_difference < 0) == lower else "↓"


def _p_text(p: float) -> str:
    return "undefined" if math.isnan(p) else f"{p:.3g}"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN or infinity


def pair_table_numbers(table: PairTable) -> dict[str, Any]:
    """The table's numbers for ``report.json``: per row and method, cell, units and the test."""
    rows: dict[str, Any] = {}
    for metric, pair in table.rows:
        methods = {}
        for label, cell in table.cells[(metric, pair)].items():
            test = cell.versus
            methods[label] = {
                "mean": cell.mean,
                "ci95": cell.ci,
                "seeds": list(cell.seeds),
                "per-seed": list(cell.per_seed),
                "units": list(cell.units),
                "versus-reference": None
                if test is None
                else {
                    "test": "welch",
                    "mean-difference": test.mean_difference,
                    "t": _finite(test.statistic),
                    "p-value": _finite(test.p_value),
                    "units": test.n,
                    "reference-units": test.n_reference,
                    "verdict": {"↑": "better", "↓": "worse", "": "n.s."}[cell.mark],
                },
                "over-seeds": None
                if cell.over_seeds is None
                else {
                    "mean-difference": cell.over_seeds.mean_difference,
                    "ci95": cell.over_seeds.ci_half_width,
                    "n": cell.over_seeds.n,
                    "p-value": cell.over_seeds.p_value,
                    "verdict": {"↑": "better", "↓": "worse", "": "n.s."}[
                        seed_mark(cell.over_seeds, metric)
                    ],
                },
            }
        rows[row_name(metric, pair)] = {
            "metric": metric,
            "pair": pair,
            "scale": scale_of(metric),
            "lower-is-better": metric in LOWER_IS_BETTER,
            "methods": methods,
        }
    return {
        "reference": table.reference,
        "test": "welch",
        "alpha": ALPHA,
        "methods": list(table.labels),
        "rows": rows,
    }
