"""The whole report of a set of runs, and its command line.

Writes to ``--out``: ``report.md`` (per setup: which variance its intervals carry (``variance``:
one data draw for every seed, or a draw per seed), the table, the paired differences and the
figures; where setups ``<base>~<name>`` ran a base setup's chosen values unchanged, whether the
base setup's verdicts against the reference hold on them (``transfer``)), ``table.md`` /
``table.tex`` (the personalization table over all setups), ``differences.md``, one
``curves-``, ``gain-`` and ``bytes-<setup>.png`` per setup, for a setup with per-client ROUGE-1
``feddpa-table-<setup>.md`` (``task_table``: FedDPA's Table 1 layout), for a setup with
per-pair metrics ``pairs-<setup>.md`` (``pair_table``: TAP's per-pair table, Welch's t-test),
for a setup with TAP's replacement flags ``replacements-<setup>.png`` (``replacements``: TAP's
Fig. 3-4), and ``report.json`` (every number in the tables and figures, per-seed headline
values, each setup's data draws under ``setup-variance``, the transfer section's numbers under
``transfer`` and the runs read). With ``--against DIR`` the report adds each method against its
own runs in DIR (``against``: tuned against untuned, after against before); with
``--conclusions-of REPORT`` whether an earlier table's verdicts against the reference hold here
(``conclusions``: a 4-trial tuned table against its 16-trial redo); with ``--pair A B``
(repeatable) A's paired difference to B over seeds, and with ``--conclusions-of`` whether the
earlier report's holds. Runs of a paper's table (``python -m fedfm_flower.sweep --table``)
also get that table in the paper's row and column order (``paper_table``; report.json
``paper-table``).
Unfinished runs are listed, not used; runs evaluated on validation data (tuning trials) are
never read; a setup without a finished run of the reference method gets its table cells and
figures but no paired tests. Exit status 2 when no finished run is
found or no setup has the reference method.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedfm_flower.records.durable import atomic_write_text
from fedfm_flower.report import (
    against,
    conclusions,
    domain_table,
    figures,
    pair_table,
    paper_table,
    replacements,
    tables,
    task_table,
    transfer,
    tuning,
    variance,
)
from fedfm_flower.report.runs import RunResult, load_runs


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def write_report(
    runs: list[RunResult],
    out: Path,
    reference: str,
    unfinished: list[Path] | None = None,
    tuning_documents: list[dict[str, Any]] | None = None,
    others: tuple[str, list[RunResult]] | None = None,
    earlier: tuple[str, dict[str, Any]] | None = None,
    pairs: Sequence[tuple[str, str]] = (),
    paper: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Render every table and figure of ``runs`` into ``out`` (``paper``: the table record of a
    ``--table`` sweep, laid out as its paper's); returns the report's numbers."""
    setups = list(dict.fromkeys(run.setup for run in runs))
    unreferenced = [
        s for s in setups if not any(r.setup == s and r.label == reference for r in runs)
    ]
    if len(unreferenced) == len(setups):
        present = sorted({r.label for r in runs})
        raise ValueError(
            f"reference method '{reference}' has no finished run; methods: {', '.join(present)}"
        )
    out.mkdir(parents=True, exist_ok=True)
    cells = tables.build_cells(runs, reference)
    metric = runs[0].metric
    caption = f"Final mean client test {metric} (%)."
    atomic_write_text(out / "table.md", tables.markdown_table(cells, reference) + "\n")
    atomic_write_text(out / "table.tex", tables.latex_table(cells, reference, caption) + "\n")
    atomic_write_text(out / "differences.md", tables.markdown_differences(cells, reference) + "\n")
    sections = [
        "# Report",
        "",
        f"{len(runs)} finished runs; {caption} Cells: mean over seeds ± 95% CI half-width "
        f"(Student t over seeds; — with one seed). ↑/↓: a paired t-test over the seeds both "
        f"ran (each seed's mean over the clients both evaluated) against **{reference}** finds "
        f"the method higher/lower at p < {tables.ALPHA}; no mark: no significant difference. "
        "The differences also show the (seed, client) units pooled, which describe the "
        "difference across clients and decide nothing. The intervals carry training "
        "variance only where every seed shares one data draw, data and training variance "
        "where each seed draws its own: see each setup.",
        "",
        tables.markdown_table(cells, reference),
        "",
    ]
    numbers: dict[str, Any] = {"reference": reference, "metric": metric, "setups": {}}
    task_tables = {setup: task_table.build_task_table(runs, setup) for setup in setups}
    pair_tables = {s: pair_table.build_pair_table(runs, s, reference) for s in setups}
    if paper is not None:
        by_domain = {}  # per-domain values: only a table whose columns are domains reads them
        if paper_table.domain_columns(paper):
            by_domain = {s: domain_table.build_domain_table(runs, s) for s in setups}
        sections += [
            paper_table.markdown_paper_table(paper, cells, task_tables, pair_tables, by_domain),
            "",
        ]
        numbers["paper-table"] = paper_table.paper_table_numbers(
            paper, cells, task_tables, pair_tables, by_domain
        )
    draws = {setup: variance.data_draws(runs, setup) for setup in setups}
    numbers["setup-variance"] = {setup: d.numbers() for setup, d in draws.items()}
    for setup in setups:
        slug = _slug(setup)
        figures.learning_curves(runs, setup, out / f"curves-{slug}.png")
        figures.bytes_chart(runs, setup, out / f"bytes-{slug}.png")
        setup_cells = {k: v for k, v in cells.items() if k[0] == setup}
        traffic = figures.bytes_per_round(runs, setup)
        sections += [f"## {setup}", "", draws[setup].text(), ""]
        if setup in unreferenced:
            sections += [f"No finished run of **{reference}** here: no paired tests.", ""]
            gain = ""
        else:
            figures.gain_density(runs, setup, reference, out / f"gain-{slug}.png")
            sections += [tables.markdown_differences(setup_cells, reference), ""]
            gain = f"![gain over {reference}](gain-{slug}.png) "
        sections += [
            f"![learning curves](curves-{slug}.png) {gain}![bytes per round](bytes-{slug}.png)",
            "",
        ]
        by_task = task_tables[setup]
        if by_task is not None:
            markdown = task_table.markdown_task_table(by_task)
            atomic_write_text(out / f"feddpa-table-{slug}.md", markdown + "\n")
            sections += [markdown, ""]
            numbers.setdefault("feddpa-tables", {})[setup] = task_table.task_table_numbers(by_task)
        by_pair = pair_tables[setup]
        if by_pair is not None:
            markdown = pair_table.markdown_pair_table(by_pair)
            atomic_write_text(out / f"pairs-{slug}.md", markdown + "\n")
            sections += [markdown, ""]
            numbers.setdefault("pair-tables", {})[setup] = pair_table.pair_table_numbers(by_pair)
        counts = replacements.replacement_counts(runs, setup)
        if counts:
            replacements.replacement_figure(counts, setup, out / f"replacements-{slug}.png")
            sections += [f"![replacements per round](replacements-{slug}.png)", ""]
            numbers.setdefault("replacements", {})[setup] = counts
        numbers["setups"][setup] = {
            label: {
                "seeds": list(cell.seeds),
                "per-seed": [
                    100 * r.final_mean
                    for r in sorted(runs, key=lambda r: r.seed)
                    if r.setup == setup and r.label == label
                ],
                "mean": cell.mean,
                "ci95": cell.ci if len(cell.seeds) > 1 else None,
                "bytes-down-per-client-round": traffic[label][0],
                "bytes-up-per-client-round": traffic[label][1],
                "versus-reference": tables.comparison_numbers(cell),
            }
            for (_, label), cell in setup_cells.items()
        }
    transferred = transfer.build_transfer(cells, reference)
    if transferred:
        sections += [transfer.markdown_transfer(transferred, reference, draws), ""]
        numbers["transfer"] = transfer.transfer_numbers(transferred, reference)
    if others is not None:
        name, other_runs = others
        rows = against.build_against(runs, other_runs)
        sections += [against.markdown_against(rows, name), ""]
        numbers["against"] = against.against_numbers(rows, name)
    if earlier is not None:
        name, document = earlier
        rows = conclusions.build_conclusions(cells, document, reference)
        sections += [conclusions.markdown_conclusions(rows, name, reference), ""]
        numbers["conclusions"] = conclusions.conclusions_numbers(rows, name)
    if pairs:
        conclusions.check_pairs(pairs, [r.label for r in runs])
        name, document = earlier if earlier is not None else (None, None)
        between = conclusions.build_between(numbers["setups"], pairs, document)
        sections += [conclusions.markdown_between(between, name), ""]
        numbers["between"] = conclusions.between_numbers(between, name)
    for document in tuning_documents or []:
        sections += [tuning.markdown_tuning(document, reference), ""]
    if tuning_documents:
        numbers["tuning"] = tuning_documents
        numbers["tuning-coverage"] = [
            tuning.coverage_flags(document["studies"], reference) for document in tuning_documents
        ]
        numbers["tuning-edges"] = [
            tuning.edge_flags(document["studies"]) for document in tuning_documents
        ]
    if unfinished:
        sections += ["## Not reported (unfinished, or a final value not finite)", ""]
        sections += [f"- `{p}`" for p in unfinished] + [""]
    numbers["runs"] = [str(r.path) for r in runs]
    numbers["unfinished"] = [str(p) for p in unfinished or []]
    atomic_write_text(out / "report.md", "\n".join(sections))
    atomic_write_text(out / "report.json", json.dumps(numbers, indent=2))
    return numbers


def main(argv: list[str] | None = None) -> int:
    """Build the report; exit status 0, or 2 when there is nothing (valid) to report."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.report", description="report over run directories"
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or folders of them")
    parser.add_argument("--out", type=Path, required=True, help="where the report goes")
    parser.add_argument(
        "--reference",
        default=None,
        help="method every other is tested against (default: the paper table's reference "
        "when the runs hold one, else local)",
    )
    parser.add_argument(
        "--metric",
        default="",
        help="client test metric to report, e.g. ttp-rouge-1 (default: the task's primary one)",
    )
    parser.add_argument(
        "--against",
        nargs="+",
        type=Path,
        default=[],
        help="other runs: each method against its own runs there (e.g. untuned)",
    )
    parser.add_argument("--against-name", default="other", help="what to call those runs")
    parser.add_argument(
        "--conclusions-of",
        type=Path,
        default=None,
        help="an earlier report (its report.json or directory): do its verdicts hold here?",
    )
    parser.add_argument(
        "--conclusions-name", default="the earlier table", help="what to call that report"
    )
    parser.add_argument(
        "--pair",
        nargs=2,
        action="append",
        default=[],
        metavar=("FIRST", "SECOND"),
        help="also test FIRST against SECOND over seeds (repeatable; with --conclusions-of, "
        "whether the earlier report's verdict holds too)",
    )
    args = parser.parse_args(argv)
    try:
        runs, unfinished = load_runs(args.runs, args.metric)
        if not runs:
            raise ValueError(f"no finished run under {', '.join(map(str, args.runs))}")
        others = None
        if args.against:
            other_runs, _ = load_runs(args.against, args.metric)
            if not other_runs:
                raise ValueError(f"no finished run under {', '.join(map(str, args.against))}")
            others = (args.against_name, other_runs)
        table = paper_table.find_table(args.runs)
        if args.reference is None:
            args.reference = (table or {}).get("reference") or "local"
        earlier = None
        if args.conclusions_of is not None:
            document = conclusions.load_earlier(args.conclusions_of, args.reference, runs[0].metric)
            earlier = (args.conclusions_name, document)
        write_report(
            runs,
            args.out,
            args.reference,
            unfinished,
            tuning.find_tuning(args.runs),
            others,
            earlier,
            [tuple(pair) for pair in args.pair],
            table,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"report of {len(runs)} runs written to {args.out}/report.md")
    return 0
