"""Whether the verdicts against the reference on a base setup hold on its transfer setups.

The tuning command runs each tuned method's chosen values unchanged on setups no trial saw:
their runs carry ``setup`` = ``<base setup>~<transfer name>`` and the base setup's seeds. Each
is a setup of the report like any other (``tables.build_cells``: a paired t-test over seeds
against the reference); here each method's verdict on the base setup is set beside its verdict
on every transfer setup of that base. Per transfer setup the outcome is ``holds`` (the same
significant verdict), ``reverses`` (the opposite one), ``n.s.`` (significant on the base setup,
not there), ``level`` (n.s. on both), ``new`` (n.s. on the base setup, significant there) or
``—`` (the method or the reference has fewer than 2 paired seeds on either setup). A verdict
holds on every transfer setup when each outcome is ``holds`` or ``level`` (``holding``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedfm_flower.report.conclusions import (
    Difference,
    difference_numbers,
    from_cell,
    text_and_verdict,
)
from fedfm_flower.report.tables import ALPHA, Cell
from fedfm_flower.report.variance import Draws
from fedfm_flower.study.cells import TRANSFER_MARK

HOLDING = ("holds", "level")  # outcomes that keep the base setup's verdict


def outcome(base: Difference | None, transfer: Difference | None) -> str:
    """A transfer setup's outcome for the base setup's difference (see the module)."""
    if base is None or transfer is None:
        return "—"
    if base.verdict == "n.s.":
        return "level" if transfer.verdict == "n.s." else "new"
    if transfer.verdict == "n.s.":
        return "n.s."
    return "holds" if transfer.verdict == base.verdict else "reverses"


@dataclass(frozen=True)
class Tested:
    """A method's paired difference to the reference on one setup."""

    setup: str
    difference: Difference | None  # None: fewer than 2 paired seeds, or no reference there
    seeds: tuple[int, ...]  # the seeds the method and the reference both ran


@dataclass(frozen=True)
class Transferred:
    """A method's difference on one transfer setup and its outcome against the base setup."""

    tested: Tested
    outcome: str  # holds, reverses, n.s., level, new or —

    def text(self) -> str:
        """The outcome, with the new verdict's direction (``new (higher)``)."""
        if self.outcome == "new" and self.tested.difference is not None:
            return f"new ({self.tested.difference.verdict})"
        return self.outcome


@dataclass(frozen=True)
class TransferRow:
    """One (base setup, method): its verdict on the base setup and on each transfer setup."""

    base: Tested
    label: str
    transfers: tuple[Transferred, ...]

    @property
    def holds(self) -> bool:
        """Whether the base verdict holds on every transfer setup (``holds`` or ``level``)."""
        return all(t.outcome in HOLDING for t in self.transfers)


def transfer_setups(setups: Iterable[str]) -> dict[str, list[str]]:
    """{base setup: its transfer setups} for every base present with a ``base~name`` setup,
    in the order the setups come."""
    setups = list(dict.fromkeys(setups))
    found: dict[str, list[str]] = {}
    for setup in setups:
        base, separator, name = setup.partition(TRANSFER_MARK)
        if separator and name and base in setups:
            found.setdefault(base, []).append(setup)
    return found


def transfer_name(setup: str) -> str:
    """The transfer name of ``base~name`` (``name``)."""
    return setup.partition(TRANSFER_MARK)[2]


def build_transfer(cells: Mapping[tuple[str, str], Cell], reference: str) -> list[TransferRow]:
    """One row per (base setup with transfer setups, method other than ``reference``) of
    ``cells`` (``tables.build_cells``): the base setup's methods first, then those only a
    transfer setup has."""
    rows = []
    for base, transfers in transfer_setups(setup for setup, _ in cells).items():
        labels = [label for setup in (base, *transfers) for s, label in cells if s == setup]
        for label in dict.fromkeys(labels):
            if label == reference:
                continue
            tested = _tested(cells, base, label)
            rows.append(
                TransferRow(
                    tested,
                    label,
                    tuple(
                        Transferred(there, outcome(tested.difference, there.difference))
                        for there in (_tested(cells, setup, label) for setup in transfers)
                    ),
                )
            )
    return rows


def _tested(cells: Mapping[tuple[str, str], Cell], setup: str, label: str) -> Tested:
    cell = cells.get((setup, label))
    if cell is None or cell.versus is None:
        return Tested(setup, None, ())
    return Tested(setup, from_cell(cell), cell.versus.seeds)


def holding(rows: Sequence[TransferRow]) -> dict[str, list[str]]:
    """{base setup: the methods whose verdict against the reference holds on every transfer
    setup} (every outcome ``holds`` or ``level``); the only transfer claims to make."""
    found: dict[str, list[str]] = {}
    for row in rows:
        kept = found.setdefault(row.base.setup, [])
        if row.holds:
            kept.append(row.label)
    return found


def markdown_transfer(
    rows: Sequence[TransferRow], reference: str, draws: Mapping[str, Draws] | None = None
) -> str:
    """The report's section: a table per base setup, each method's difference to
    ``reference`` there and on each transfer setup, with the outcome; ``draws`` (per setup)
    says whether the transfer setups' seeds are data draws."""
    lines = [
        "## Transfer: do the verdicts hold on setups no trial saw?",
        "",
        "Each tuned method's chosen values, run unchanged on setups no trial saw (`<base "
        "setup>~<name>`) at the base setup's seeds; "
        + _seeds_text(rows, draws)
        + f" Each verdict against **{reference}** is re-tested there: Δ [95% CI], p of the "
        f"paired t-test over seeds (higher/lower: p < {ALPHA}, else n.s.). Outcome: holds "
        "(the same significant verdict), reverses (the opposite one), n.s. (significant on "
        "the base setup, not on the transfer setup), level (n.s. on both), new (n.s. on the "
        "base setup, significant on the transfer setup), — (the method or the reference has "
        "fewer than 2 paired seeds on either setup).",
        "",
    ]
    kept = holding(rows)
    for base, labels in kept.items():
        mine = [row for row in rows if row.base.setup == base]
        names = [transfer_name(t.tested.setup) for t in mine[0].transfers]
        header = f"| method | {base}: Δ [95% CI], p | verdict |"
        header += "".join(f" {name}: Δ [95% CI], p | outcome |" for name in names)
        lines += [f"### {base}", "", header, "|---|---|---|" + "---|---|" * len(names)]
        for row in mine:
            cells = [row.label, *text_and_verdict(row.base.difference)]
            for there in row.transfers:
                cells += [_text(there.tested.difference), there.text()]
            lines.append("| " + " | ".join(cells) + " |")
        lines += [
            "",
            f"{len(labels)} of {len(mine)} verdicts hold on every transfer setup"
            + (f": {', '.join(labels)}." if labels else "."),
            "",
        ]
    return "\n".join(lines).rstrip("\n")


def _seeds_text(rows: Sequence[TransferRow], draws: Mapping[str, Draws] | None) -> str:
    known = draws or {}
    setups = {t.tested.setup for row in rows for t in row.transfers}
    kinds = {known[s].variance if s in known else None for s in setups}
    if kinds == {"data-and-training"}:
        return "each seed is a data draw and a training run (see each setup)."
    if kinds == {"training"}:
        return "their seeds share one data draw: training variance only (see each setup)."
    return "which variance their seeds carry: see each setup."


def _text(difference: Difference | None) -> str:
    return "—" if difference is None else difference.text()


def transfer_numbers(rows: Sequence[TransferRow], reference: str) -> dict[str, Any]:
    """The section's numbers for report.json (metric units x 100)."""
    kept = holding(rows)
    bases: dict[str, Any] = {}
    for base, labels in kept.items():
        mine = [row for row in rows if row.base.setup == base]
        bases[base] = {
            "transfers": [t.tested.setup for t in mine[0].transfers],
            "rows": [
                {
                    "method": row.label,
                    "base": _tested_numbers(row.base),
                    "transfers": [
                        {**_tested_numbers(t.tested), "outcome": t.outcome} for t in row.transfers
                    ],
                    "holds-on-every-transfer": row.holds,
                }
                for row in mine
            ],
            "hold": labels,
        }
    return {"reference": reference, "alpha": ALPHA, "bases": bases}


def _tested_numbers(tested: Tested) -> dict[str, Any]:
    return {
        "setup": tested.setup,
        "seeds": list(tested.seeds),
        "difference": difference_numbers(tested.difference),
    }
