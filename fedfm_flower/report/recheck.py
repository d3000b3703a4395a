"""A committed report's verdicts tested again over seeds, from its ``report.json`` alone.

Reports written before the verdicts were tested over seeds (``tables``) pooled the (seed, client)
units as independent. Their runs are often gone; their ``report.json`` keeps each method's
per-seed means, which is what the test over seeds needs (``conclusions.from_recorded``). This
lists, per report, setup and method, the verdict as recorded and over seeds, and says which
changed::

    python -m fedfm_flower.report.recheck bench/results --out bench/results/verdicts-over-seeds.md

A per-seed mean is over all of the run's clients; the test pairs methods by seed, which is the
table's test wherever both runs evaluated every client.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfm_flower.records.durable import atomic_write_text
from fedfm_flower.report.conclusions import RECORDED, Difference, from_recorded


@dataclass(frozen=True)
class Recheck:
    """One (report, setup, method): the verdict it recorded and the one over seeds."""

    report: str
    setup: str
    label: str
    reference: str
    recorded: str  # "higher", "lower" or "n.s."
    over_seeds: Difference | None  # None below two shared seeds

    @property
    def changed(self) -> bool:
        """Whether the verdict over seeds differs from the recorded one."""
        return self.over_seeds is not None and self.over_seeds.verdict != self.recorded


def recheck_report(path: Path, document: dict[str, Any]) -> list[Recheck]:
    """Every method but the reference, in every setup of a ``report.json``."""
    reference = str(document.get("reference"))
    rows = []
    for setup, entries in document.get("setups", {}).items():
        for label, entry in entries.items():
            versus = entry.get("versus-reference")
            if label == reference or not versus:
                continue
            recorded = RECORDED.get(str(versus.get("verdict")), "n.s.")
            pooled = {k: v for k, v in entry.items() if k != "versus-reference"}
            pooled["versus-reference"] = {k: v for k, v in versus.items() if k != "test"}
            over = from_recorded(pooled, entries.get(reference))
            rows.append(Recheck(str(path), setup, label, reference, recorded, over))
    return rows


def find_reports(paths: list[Path]) -> list[Path]:
    """``report.json`` files at or below ``paths``."""
    found = []
    for path in paths:
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(path.rglob("report.json"))
        else:
            raise FileNotFoundError(f"no such report or folder: {path}")
    return found


def markdown_recheck(rows: list[Recheck]) -> str:
    """The changed verdicts first, then a count per report."""
    changed = [row for row in rows if row.changed]
    tested = [row for row in rows if row.over_seeds is not None]
    lines = [
        "# Recorded verdicts tested over seeds",
        "",
        f"{len(tested)} comparisons with 2 or more seeds; **{len(changed)} change** when tested "
        "over seeds (each seed's mean over its clients, paired by seed) instead of over the "
        "(seed, client) units pooled.",
        "",
        "| report | setup | method | against | recorded | over seeds: Δ [95% CI], p | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in changed:
        assert row.over_seeds is not None
        lines.append(
            f"| `{row.report}` | {row.setup} | {row.label} | {row.reference} | {row.recorded} | "
            f"{row.over_seeds.text().rstrip('*')} | {row.over_seeds.verdict} |"
        )
    lines += ["", "| report | comparisons | changed |", "|---|---:|---:|"]
    for report in dict.fromkeys(row.report for row in rows):
        mine = [row for row in tested if row.report == report]
        lines.append(f"| `{report}` | {len(mine)} | {sum(row.changed for row in mine)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Recheck the reports; exit status 0, or 2 when none is found or one does not read."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.report.recheck", description=__doc__.split("\n")[0]
    )
    parser.add_argument("reports", nargs="+", type=Path, help="report.json files or folders")
    parser.add_argument("--out", type=Path, default=None, help="a Markdown file (else stdout)")
    args = parser.parse_args(argv)
    try:
        rows = []
        for path in find_reports(args.reports):
            try:
                document = json.loads(path.read_text())
            except ValueError as err:
                raise ValueError(f"{path} is not JSON: {err}") from None
            rows += recheck_report(path, document)
        if not rows:
            raise ValueError(f"no comparison in {', '.join(map(str, args.reports))}")
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = markdown_recheck(rows) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        atomic_write_text(args.out, text)
        print(f"{sum(r.changed for r in rows)} of {len(rows)} verdicts change; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
