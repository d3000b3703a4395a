"""The personalization table: mean and 95% interval over seeds, paired tests against a reference.

For each (setup, method) the headline number of a seed is the mean over clients of the final
metric; a cell shows the mean of those over seeds with the half-width of its Student-t 95%
interval. Each method is compared with the reference method by a two-sided paired t-test over
matched (seed, client) units: the same seed gives every method the same partition and test
split, so a per-client difference isolates the method. A cell is marked a win (``↑``) or a
loss (``↓``) only when that test rejects "no difference" at the 5% level; the interval of the
mean paired difference says which differences the setup can resolve. Units of one seed share
a federation, so they are not fully independent; the per-seed interval is the conservative
companion figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedfm_flower.report.runs import RunResult
from fedfm_flower.statistics import PairedTest, mean_ci, paired_test

ALPHA = 0.05


@dataclass(frozen=True)
class Cell:
    """One (setup, method) entry of the table, in the metric's units x ``scale``."""

    setup: str
    label: str
    seeds: tuple[int, ...]
    mean: float
    ci: float  # 95% half-width over seeds
    versus: PairedTest | None  # against the reference; None for the reference itself

    @property
    def mark(self) -> str:
        """'↑' a significant win over the reference, '↓' a significant loss, '' neither."""
        if self.versus is None or not self.versus.significant(ALPHA):
            return ""
        return "↑" if self.versus.mean_difference > 0 else "↓"


def paired_units(a: RunResult, b: RunResult) -> tuple[list[float], list[float]]:
    """The two runs' final per-client values over the clients both evaluated, by client id."""
    shared = sorted(set(a.final) & set(b.final))
    return [a.final[c] for c in shared], [b.final[c] for c in shared]


def by_cell(runs: Sequence[RunResult]) -> dict[tuple[str, str], dict[int, RunResult]]:
    """``runs`` as {(setup, label): {seed: run}}, in the order they come."""
    grouped: dict[tuple[str, str], dict[int, RunResult]] = {}
    for run in runs:
        grouped.setdefault((run.setup, run.label), {})[run.seed] = run
    return grouped


def build_cells(
    runs: Sequence[RunResult], reference: str, scale: float = 100.0
) -> dict[tuple[str, str], Cell]:
    """{(setup, label): Cell} over every setup and method present in ``runs``."""
    grouped = by_cell(runs)
    cells = {}
    for (setup, label), by_seed in grouped.items():
        seeds = tuple(sorted(by_seed))
        mean, ci = mean_ci([scale * by_seed[s].final_mean for s in seeds])
        versus = None
        baseline = grouped.get((setup, reference))
        if label != reference and baseline:
            a, b = [], []
            for seed in sorted(set(seeds) & set(baseline)):
                x, y = paired_units(by_seed[seed], baseline[seed])
                a += [scale * v for v in x]
                b += [scale * v for v in y]
            versus = paired_test(a, b) if len(a) >= 2 else None
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
            row.append("—" if cell is None else f"{cell.mean:.2f} ± {cell.ci:.2f}{cell.mark}")
        name = f"{label} (reference)" if label == reference else label
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown_differences(cells: dict[tuple[str, str], Cell], reference: str) -> str:
    """Per setup and method: the mean paired difference to the reference, its 95% interval,
    the number of (seed, client) units and the p-value."""
    lines = [
        f"| setup | method | Δ vs {reference} | 95% CI of Δ | units | p | verdict |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for (setup, label), cell in cells.items():
        test = cell.versus
        if test is None:
            continue
        low, high = (
            test.mean_difference - test.ci_half_width,
            test.mean_difference + test.ci_half_width,
        )
        verdict = {"↑": "better", "↓": "worse", "": "no significant difference"}[cell.mark]
        lines.append(
            f"| {setup} | {label} | {test.mean_difference:+.2f} | [{low:+.2f}, {high:+.2f}] | "
            f"{test.n} | {test.p_value:.3g} | {verdict} |"
        )
    return "\n".join(lines)


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
            row.append(
                "--" if cell is None else f"{cell.mean:.2f} $\\pm$ {cell.ci:.2f}{arrows[cell.mark]}"
            )
        lines.append(escape(label) + " & " + " & ".join(row) + r" \\")
    lines += [
        r"\bottomrule",
        r"\end{tabular}",
        f"\\caption{{{escape(caption)} Mean over seeds $\\pm$ 95\\% CI half-width; "
        f"$\\uparrow$/$\\downarrow$: paired t-test over (seed, client) against "
        f"{escape(reference)}, $p < {ALPHA}$.}}",
        r"\end{table}",
    ]
    return "\n".join(lines)
