"""The personalization table: mean and 95% interval over seeds, paired tests against a reference.

For each (setup, method) the headline number of a seed is the mean over clients of the final
metric; a cell shows the mean of those over seeds with the half-width of its Student-t 95%
interval (none with one seed). Each method is compared with the reference method over the seeds
both ran (``compare``): per seed, the mean over the clients both evaluated of each method (the
same seed gives every method the same partition and test split), then a two-sided paired t-test
over those seeds. A cell is marked ``↑`` (higher) or ``↓`` (lower) only when that test rejects
"no difference" at the 5% level.

The seed is the unit because the seed is what is replicated: the clients of one seed share a
federation, a partition and a training run, so their differences are not independent draws.
For a balanced design this test is the test of the mean in a model with a random effect per
seed (it equals the t-test on the seed means), so it is not merely conservative; a test that
pools the (seed, client) units as independent overstates the evidence whenever the difference
varies from seed to seed, and with 3 seeds it called about a third of the differences of the
committed reports significant that the seeds do not support. That pooled test is still
reported (``Comparison.pooled``), as a description of how consistent the difference is across
clients, never as a verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedfm_flower.report.runs import RunResult
from fedfm_flower.study.grid_foundations import SetupFoundations
from fedfm_flower.study.statistics import PairedTest, mean_ci, paired_test

ALPHA = 0.05


@dataclass(frozen=True)
class Comparison:
    """a - b over the seeds both ran: the verdict's test over seeds, and the units pooled."""

    seeds: tuple[int, ...]  # the seeds both ran
    test: PairedTest | None  # over the seeds' client means; None below 2 seeds
    pooled: PairedTest | None  # over (seed, client) units as if independent: not a verdict

    @property
    def verdict(self) -> str:
        """'higher' or 'lower' (the test over seeds, p < ALPHA), else 'n.s.'."""
        return verdict_of(self.test)


def verdict_of(test: PairedTest | None) -> str:
    """'higher' or 'lower' where ``test`` rejects "no difference" at ALPHA, else 'n.s.'."""
    if test is None or not test.significant(ALPHA):
        return "n.s."
    return "higher" if test.mean_difference > 0 else "lower"


@dataclass(frozen=True)
class Cell:
    """One (setup, method) entry of the table, in the metric's units x ``scale``."""

    setup: str
    label: str
    seeds: tuple[int, ...]
    mean: float
    ci: float  # 95% half-width over seeds (0 with one seed: shown as none)
    versus: Comparison | None  # against the reference; None for the reference itself

    @property
    def mark(self) -> str:
        """'↑' significantly higher than the reference over seeds, '↓' lower, '' neither."""
        verdict = "n.s." if self.versus is None else self.versus.verdict
        return {"higher": "↑", "lower": "↓", "n.s.": ""}[verdict]

    def text(self) -> str:
        """``mean ± ci`` and the mark (``mean ± —`` with one seed)."""
        spread = f"{self.ci:.2f}" if len(self.seeds) > 1 else "—"
        return f"{self.mean:.2f} ± {spread}{self.mark}"


def paired_units(a: RunResult, b: RunResult) -> tuple[list[float], list[float]]:
    """The two runs' final per-client values over the clients both evaluated, by client id."""
    shared = sorted(set(a.final) & set(b.final))
    return [a.final[c] for c in shared], [b.final[c] for c in shared]


def compare(
    mine: dict[int, RunResult], theirs: dict[int, RunResult], scale: float = 100.0
) -> Comparison:
    """``mine`` - ``theirs`` (runs by seed) over the seeds and clients both have."""
    seeds = tuple(sorted(set(mine) & set(theirs)))
    a_means, b_means, a_units, b_units = [], [], [], []
    for seed in seeds:
        x, y = paired_units(mine[seed], theirs[seed])
        if not x:
            continue
        a_units += [scale * v for v in x]
        b_units += [scale * v for v in y]
        a_means.append(scale * sum(x) / len(x))
        b_means.append(scale * sum(y) / len(y))
    test = paired_test(a_means, b_means) if len(a_means) >= 2 else None
    pooled = paired_test(a_units, b_units) if len(a_units) >= 2 else None
    return Comparison(seeds, test, pooled)


def by_cell(runs: Sequence[RunResult]) -> dict[tuple[str, str], dict[int, RunResult]]:
    """``runs`` as {(setup, label): {seed: run}}, in the order they come; ValueError naming
    both run directories when two runs share a (setup, label, seed)."""
    grouped: dict[tuple[str, str], dict[int, RunResult]] = {}
    for run in runs:
        by_seed = grouped.setdefault((run.setup, run.label), {})
        if run.seed in by_seed:
            raise ValueError(
                f"two runs of {run.label} on {run.setup} at seed {run.seed}: "
                f"{by_seed[run.seed].path} and {run.path}; report one of them"
            )
        by_seed[run.seed] = run
    refuse_mixed_foundations(runs)
    return grouped


def refuse_mixed_foundations(runs: Sequence[RunResult]) -> None:
    """``FoundationMismatch`` (a ValueError) naming two runs of one setup and seed that ran on
    different foundation models: other keys (another recipe, e.g. a run made before the
    foundation followed the data seed) or other builds of one key (other weights:
    ``foundation_cards``). Pairing them would compare the models as much as the methods."""
    found = SetupFoundations(
        remedy="Rerun one side on the other's model (a tuning study keeps its builds: "
        "docs/tuning.md)"
    )
    for run in runs:
        found.check(run.setup, run.seed, run.path, run.foundation)


def build_cells(
    runs: Sequence[RunResult], reference: str, scale: float = 100.0
) -> dict[tuple[str, str], Cell]:
    """{(setup, label): Cell} over every setup and method present in ``runs``."""
    grouped = by_cell(runs)
    cells = {}
    for (setup, label), by_seed in grouped.items():
        seeds = tuple(sorted(by_seed))
        mean, ci = mean_ci([scale * by_seed[s].final_mean for s in seeds])
        baseline = grouped.get((setup, reference))
        versus = compare(by_seed, baseline, scale) if label != reference and baseline else None
        cells[(setup, label)] = Cell(setup, label, seeds, mean, ci, versus)
    return cells


def _order(cells: dict[tuple[str, str], Cell]) -> tuple[list[str], list[str]]:
    setups = list(dict.fromkeys(s for s, _ in cells))
    labels = list(dict.fromkeys(label for _, label in cells))
    return setups, labels


def markdown_table(cells: dict[tuple[str, str], Cell], reference: str) -> str:
    """Methods x setups: ``mean ± ci`` with the significance mark against ``reference``."""
    setups, labels = _order(cells)
    lines = [
        "| method | " + " | ".join(setups) + " |",
        "|---|" + "---:|" * len(setups),
    ]
    for label in labels:
        row = []
        for setup in setups:
            cell = cells.get((setup, label))
            row.append("—" if cell is None else cell.text())
        name = f"{label} (reference)" if label == reference else label
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown_differences(cells: dict[tuple[str, str], Cell], reference: str) -> str:
    """Per setup and method: the mean paired difference to the reference over the seeds both
    ran, its 95% interval, the seeds, the p-value and the verdict; then the (seed, client)
    units pooled, which describe the difference across clients and decide nothing."""
    lines = [
        f"| setup | method | Δ vs {reference} | 95% CI of Δ (seeds) | seeds | p | verdict | "
        "units pooled: 95% CI, p (not a verdict) |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for (setup, label), cell in cells.items():
        versus = cell.versus
        if versus is None or (versus.test is None and versus.pooled is None):
            continue
        test, pooled = versus.test, versus.pooled
        delta = interval = p = "—"
        if test is not None:
            delta, interval = f"{test.mean_difference:+.2f}", interval_text(test)
            p = f"{test.p_value:.3g}"
        units = pooled_text(pooled)
        lines.append(
            f"| {setup} | {label} | {delta} | {interval} | {len(versus.seeds)} | {p} | "
            f"{versus.verdict} | {units} |"
        )
    return "\n".join(lines)


def comparison_numbers(cell: Cell) -> dict[str, Any] | None:
    """A cell's ``versus-reference`` in report.json: the test over seeds (``test``:
    ``"seeds"``) with its verdict as the cell's mark, and the pooled units apart."""
    versus = cell.versus
    if versus is None:
        return None

    def numbers(test: PairedTest | None) -> dict[str, Any]:
        if test is None:
            return {"mean-difference": None, "ci95": None, "n": 0, "p-value": None}
        return {
            "mean-difference": test.mean_difference,
            "ci95": test.ci_half_width,
            "n": test.n,
            "p-value": test.p_value,
        }

    return {
        "test": "seeds",
        **numbers(versus.test),
        "seeds": list(versus.seeds),
        "verdict": cell.mark or "n.s.",
        "pooled-units": numbers(versus.pooled),
    }


def pooled_text(pooled: PairedTest | None) -> str:
    """The pooled units' ``[low, high], p (n)``, or ``—``."""
    if pooled is None:
        return "—"
    return f"{interval_text(pooled)}, {pooled.p_value:.3g} ({pooled.n})"


def interval_text(test: PairedTest) -> str:
    """``[low, high]`` of a test's 95% interval of the mean difference."""
    low, high = test.mean_difference - test.ci_half_width, test.mean_difference + test.ci_half_width
    return f"[{low:+.2f}, {high:+.2f}]"


def latex_table(cells: dict[tuple[str, str], Cell], reference: str, caption: str) -> str:
    """The Markdown table as a LaTeX ``table`` (booktabs), marks as arrows."""
    setups, labels = _order(cells)
    arrows = {"↑": r"$^{\uparrow}$", "↓": r"$^{\downarrow}$", "": ""}

    def escape(text: str) -> str:
        return text.replace("_", r"\_").replace("&", r"\&").replace("%", r"\%")

    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\begin{tabular}{l" + "r" * len(setups) + "}",
        r"\toprule",
        "method & " + " & ".join(escape(s) for s in setups) + r" \\",
        r"\midrule",
    ]
    for label in labels:
        row = []
        for setup in setups:
            cell = cells.get((setup, label))
            spread = "--" if cell is None or len(cell.seeds) < 2 else f"{cell.ci:.2f}"
            row.append(
                "--" if cell is None else f"{cell.mean:.2f} $\\pm$ {spread}{arrows[cell.mark]}"
            )
        lines.append(escape(label) + " & " + " & ".join(row) + r" \\")
    lines += [
        r"\bottomrule",
        r"\end{tabular}",
        f"\\caption{{{escape(caption)} Mean over seeds $\\pm$ 95\\% CI half-width; "
        f"$\\uparrow$/$\\downarrow$: paired t-test over seeds against "
        f"{escape(reference)}, $p < {ALPHA}$.}}",
        r"\end{table}",
    ]
    return "\n".join(lines)
