"""Whether an earlier table's conclusions hold in this one (a 4-trial tuned table against its
16-trial redo): per setup and method, the sign and significance of the method's paired
difference to the reference in each table.

The earlier table is read from its ``report.json``, so its runs need not be kept. A conclusion
is the verdict against the reference over the seeds both ran (``tables.compare``): ``higher``
or ``lower`` (p < ``ALPHA``) or ``n.s.``; it holds when both tables give the same verdict. A
report written since the verdicts are tested over seeds records that test
(``versus-reference`` with ``test`` = ``"seeds"``); an older one recorded a test over the
(seed, client) units pooled, whose verdict is not comparable, so its test over seeds is
recomputed from the per-seed means it records of the method and of the reference (the mean over
each run's clients: the clients both evaluated wherever every client was evaluated) and marked
so. A method in only one table is listed as such; both tables must have the same reference and
metric.

Between two methods other than the reference (``--pair``), both tables' differences are the
paired test over seeds of the per-seed means each report records (``Between``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfm_flower.report.tables import ALPHA, Cell, verdict_of
from fedfm_flower.study.statistics import paired_test


@dataclass(frozen=True)
class Difference:
    """A method's paired difference to the reference over seeds in one table (metric units x
    100)."""

    mean: float
    ci: float  # 95% half-width
    p_value: float
    verdict: str  # "higher", "lower" or "n.s."
    recomputed: bool = False  # from an older report's per-seed means

    def text(self) -> str:
        """``+1.24 [+0.09, +2.39], p = 0.0362`` (``*``: recomputed over seeds)."""
        low, high = self.mean - self.ci, self.mean + self.ci
        star = "*" if self.recomputed else ""
        return f"{self.mean:+.2f} [{low:+.2f}, {high:+.2f}], p = {self.p_value:.3g}{star}"


@dataclass(frozen=True)
class Level:
    """A method's mean over seeds and its 95% CI half-width in one table (metric units x
    100)."""

    mean: float
    ci: float

    def text(self) -> str:
        """``75.28 ± 1.79``."""
        return f"{self.mean:.2f} ± {self.ci:.2f}"


@dataclass(frozen=True)
class Conclusion:
    """One (setup, method): its level, and its difference to the reference, in this table and
    the earlier."""

    setup: str
    label: str
    this: Difference | None  # None: not in this table
    earlier: Difference | None  # None: not in the earlier table
    this_level: Level | None = None
    earlier_level: Level | None = None

    @property
    def holds(self) -> bool | None:
        """Same verdict in both tables; None when one table lacks the method."""
        return agree(self.this, self.earlier)


def agree(this: Difference | None, earlier: Difference | None) -> bool | None:
    """Whether two tables' differences give one verdict; None when either table lacks it."""
    if this is None or earlier is None:
        return None
    return this.verdict == earlier.verdict


HOLDS_TEXT = {True: "yes", False: "**no**", None: "(not in both)"}  # a row's holds? column

VERDICTS = {"↑": "higher", "↓": "lower", "": "n.s."}
# report.json records a verdict as the table's mark (↑, ↓) or "n.s."
RECORDED = {"↑": "higher", "↓": "lower", "n.s.": "n.s."}


def from_cell(cell: Cell) -> Difference | None:
    """This table's difference for a cell (None for the reference or without a test over
    seeds)."""
    if cell.versus is None or cell.versus.test is None:
        return None
    test = cell.versus.test
    return Difference(test.mean_difference, test.ci_half_width, test.p_value, VERDICTS[cell.mark])


def from_recorded(
    entry: Mapping[str, Any], reference: Mapping[str, Any] | None = None
) -> Difference | None:
    """A difference as ``report.json`` records it (``versus-reference``), or None; an older
    report's pooled test is replaced by the test over seeds of its per-seed means against
    ``reference``'s (the reference's entry in the same setup)."""
    versus = entry.get("versus-reference")
    if not versus:
        return None
    if versus.get("test") != "seeds":
        return _recomputed_over_seeds(entry, reference)
    if versus.get("mean-difference") is None:
        return None  # fewer than two seeds: no test
    verdict = RECORDED.get(str(versus.get("verdict")))
    if verdict is None:
        raise ValueError(f"unknown verdict {versus.get('verdict')!r} in the earlier report")
    return Difference(
        float(versus["mean-difference"]), float(versus["ci95"]), float(versus["p-value"]), verdict
    )


def _recomputed_over_seeds(
    entry: Mapping[str, Any], reference: Mapping[str, Any] | None
) -> Difference | None:
    """The test over seeds of an older report's entry: its per-seed means paired by seed with
    the reference's; None below two shared seeds or without the reference."""
    if reference is None:
        return None
    return _over_seeds(entry, reference, recomputed=True)


def _over_seeds(
    entry: Mapping[str, Any], other: Mapping[str, Any], recomputed: bool = False
) -> Difference | None:
    """The paired test over the seeds both ran of two report.json entries' per-seed means
    (``entry`` − ``other``); None below two shared seeds."""
    mine = dict(zip(entry.get("seeds", []), entry.get("per-seed", []), strict=False))
    theirs = dict(zip(other.get("seeds", []), other.get("per-seed", []), strict=False))
    shared = sorted(set(mine) & set(theirs))
    if len(shared) < 2:
        return None
    test = paired_test([float(mine[s]) for s in shared], [float(theirs[s]) for s in shared])
    return Difference(
        test.mean_difference, test.ci_half_width, test.p_value, verdict_of(test), recomputed
    )


@dataclass(frozen=True)
class Between:
    """One (setup, pair of methods): the first's paired difference to the second over seeds,
    in this table and in the earlier one."""

    setup: str
    first: str
    second: str
    this: Difference | None  # None: a method not in this table's setup, or below two seeds
    earlier: Difference | None  # None: no earlier table, or a method not in it

    @property
    def holds(self) -> bool | None:
        """Same verdict in both tables; None when one lacks the comparison."""
        return agree(self.this, self.earlier)


def check_pairs(pairs: Sequence[tuple[str, str]], labels: Sequence[str]) -> None:
    """ValueError naming a pair of one method twice, or a method no run of this table has."""
    for first, second in pairs:
        if first == second:
            raise ValueError(f"--pair {first} {second}: a method is not compared with itself")
        for label in (first, second):
            if label not in labels:
                raise ValueError(
                    f"--pair {first} {second}: no finished run of '{label}' (methods: "
                    f"{', '.join(sorted(set(labels)))})"
                )


def build_between(
    setups: Mapping[str, Mapping[str, Any]],
    pairs: Sequence[tuple[str, str]],
    earlier: Mapping[str, Any] | None = None,
) -> list[Between]:
    """Each pair in each setup where this table has either method: the test over seeds of
    the per-seed means ``setups`` (report.json's ``setups``) records, and the earlier
    report's of the same setup."""
    rows = []
    for setup, entries in setups.items():
        recorded = (earlier or {}).get("setups", {}).get(setup, {})
        for first, second in pairs:
            if first not in entries and second not in entries:
                continue
            rows.append(
                Between(
                    setup,
                    first,
                    second,
                    _pair(entries, first, second),
                    _pair(recorded, first, second),
                )
            )
    return rows


def _pair(entries: Mapping[str, Any], first: str, second: str) -> Difference | None:
    if first not in entries or second not in entries:
        return None
    return _over_seeds(entries[first], entries[second])


def markdown_between(rows: Sequence[Between], name: str | None) -> str:
    """The report's section: each pair's difference over seeds here (and in ``name``)."""
    lines = [
        "## Between methods",
        "",
        "The first method's paired difference to the second over the seeds both ran (Δ [95% "
        f"CI], p; a paired t-test of the seeds' mean values); higher/lower: p < {ALPHA}, else "
        "n.s." + (f" A conclusion holds when {name} and this table agree." if name else ""),
        "",
    ]
    if name:
        lines += [
            f"| setup | comparison | {name} | verdict | here | verdict | holds? |",
            "|---|---|---|---|---|---|---|",
        ]
    else:
        lines += ["| setup | comparison | here | verdict |", "|---|---|---|---|"]
    for row in rows:
        cells = [row.setup, f"{row.first} − {row.second}"]
        if name:
            cells += text_and_verdict(row.earlier)
        cells += text_and_verdict(row.this)
        if name:
            cells.append(HOLDS_TEXT[row.holds])
        lines.append("| " + " | ".join(cells) + " |")
    if name:
        compared = [row for row in rows if row.holds is not None]
        held = sum(bool(row.holds) for row in compared)
        lines += ["", f"{held} of {len(compared)} conclusions between methods hold."]
    return "\n".join(lines)


def text_and_verdict(difference: Difference | None) -> list[str]:
    """A difference's table cells: its text and its verdict (``—``, ``—``: none)."""
    if difference is None:
        return ["—", "—"]
    return [difference.text(), difference.verdict]


def between_numbers(rows: Sequence[Between], name: str | None) -> dict[str, Any]:
    """The section's numbers for report.json."""
    return {
        "name": name,
        "rows": [
            {
                "setup": row.setup,
                "first": row.first,
                "second": row.second,
                "here": difference_numbers(row.this),
                "earlier": difference_numbers(row.earlier),
                "holds": row.holds,
            }
            for row in rows
        ],
    }


def load_earlier(path: Path, reference: str, metric: str) -> dict[str, Any]:
    """The earlier ``report.json`` (a file, or a report directory holding one); ValueError when
    its reference or metric differs from this table's."""
    file = path / "report.json" if path.is_dir() else path
    try:
        document = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"no earlier report at {file}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"the earlier report {file} is not JSON: {err}") from None
    if not isinstance(document, dict) or not isinstance(document.get("setups"), dict):
        raise ValueError(f"the earlier report {file} has no 'setups'")
    if document.get("reference") != reference:
        raise ValueError(
            f"the earlier report's reference is {document.get('reference')!r}, not {reference!r}"
        )
    if document.get("metric") != metric:
        raise ValueError(
            f"the earlier report's metric is {document.get('metric')!r}, not {metric!r}"
        )
    return document


def build_conclusions(
    cells: Mapping[tuple[str, str], Cell], earlier: Mapping[str, Any], reference: str
) -> list[Conclusion]:
    """Every (setup, method) but the reference in either table: this table's setups and
    methods first, then the earlier table's that this one lacks."""
    rows = []
    setups = list(dict.fromkeys([*(setup for setup, _ in cells), *earlier["setups"]]))
    for setup in setups:
        recorded = earlier["setups"].get(setup, {})
        labels = [label for s, label in cells if s == setup]
        labels += [label for label in recorded if label not in labels]
        for label in labels:
            if label == reference:
                continue
            cell = cells.get((setup, label))
            entry = recorded.get(label)
            rows.append(
                Conclusion(
                    setup,
                    label,
                    None if cell is None else from_cell(cell),
                    None if entry is None else from_recorded(entry, recorded.get(reference)),
                    None if cell is None else Level(cell.mean, cell.ci),
                    None if entry is None else recorded_level(entry),
                )
            )
    return rows


def recorded_level(entry: Mapping[str, Any]) -> Level | None:
    """A method's level as ``report.json`` records it; None without a mean."""
    if entry.get("mean") is None:
        return None
    return Level(float(entry["mean"]), float(entry.get("ci95") or 0.0))


def markdown_conclusions(rows: Sequence[Conclusion], name: str, reference: str) -> str:
    """The report's section: each method's difference to the reference in both tables."""
    lines = [
        f"## Conclusions of {name}: do they hold here?",
        "",
        f"Each method's mean ± 95% CI over seeds and its paired difference to **{reference}** "
        f"over seeds (Δ [95% CI], p) in {name} and here; a conclusion is the verdict "
        f"(higher/lower: p < {ALPHA}, else n.s.), and it holds when both verdicts agree. `*`: "
        "recomputed over seeds from the per-seed means of a report that tested the (seed, "
        "client) units pooled.",
        "",
        f"| setup | method | {name} | Δ | verdict | here | Δ | verdict | holds? |",
        "|---|---|---:|---|---|---:|---|---|---|",
    ]
    for row in rows:
        cells = [row.setup, row.label, _level_text(row.earlier_level)]
        cells += [*text_and_verdict(row.earlier), _level_text(row.this_level)]
        cells += [*text_and_verdict(row.this), HOLDS_TEXT[row.holds]]
        lines.append("| " + " | ".join(cells) + " |")
    compared = [row for row in rows if row.holds is not None]
    changed = [row.label for row in compared if not row.holds]
    lines += [
        "",
        f"{len(compared) - len(changed)} of {len(compared)} conclusions hold"
        + (f"; changed: {', '.join(changed)}." if changed else "."),
    ]
    return "\n".join(lines)


def _level_text(level: Level | None) -> str:
    return "—" if level is None else level.text()


def difference_numbers(difference: Difference | None) -> dict[str, Any] | None:
    """A difference as report.json records it (None: no difference)."""
    if difference is None:
        return None
    return {
        "mean-difference": difference.mean,
        "ci95": difference.ci,
        "p-value": difference.p_value,
        "verdict": difference.verdict,
        "recomputed-over-seeds": difference.recomputed,
    }


def conclusions_numbers(rows: Sequence[Conclusion], name: str) -> dict[str, Any]:
    """The section's numbers for report.json."""
    return {
        "name": name,
        "rows": [
            {
                "setup": row.setup,
                "method": row.label,
                "here": difference_numbers(row.this),
                "earlier": difference_numbers(row.earlier),
                "here-level": _level_numbers(row.this_level),
                "earlier-level": _level_numbers(row.earlier_level),
                "holds": row.holds,
            }
            for row in rows
        ],
    }


def _level_numbers(level: Level | None) -> dict[str, float] | None:
    return None if level is None else {"mean": level.mean, "ci95": level.ci}
