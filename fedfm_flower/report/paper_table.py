"""A paper's table as the paper lays it out: its rows and columns in its order, ours beside its
figures (``fedfm_flower.study.paper_tables``; the sweep's ``--table`` leaves ``table.json``).

A cell is ours (mean ± 95% CI over seeds, the mark against the report's reference) and, on the
paper's own setting, the paper's figure. On the offline stand-ins the paper's figures measure
another dataset and model, so they are not set beside ours. A row the framework lacks says why,
as does a row lacking some columns (its method per column, ``labels``: FedPerfix's Table 3 has
no FedPerfix on the ResNet50); a cell without finished runs shows a dash.

A table whose columns are client tasks (FedDPA's Table 1) takes each cell from the per-task
table of the column's setup (``task_table.build_task_table``): the row's block, the row's
method, the column's task; the same cell (mean ± 95% CI over seeds) as that table's, with no
mark (the task table tests nothing against the reference). Rows are grouped under their
block's title as in the paper; where the columns name the blocks instead (FedDPA's ablation
tables; its Table 14, whose columns are unseen test-time tasks at the AVG or MAX block), a cell
is the column's block's and the column's header names its task, setup and block. A declared
task that no client of the runs has (an unseen task: that no run answered) is named below the
table with the tasks the runs do have (a dash alone would hide a misnamed task).

A table whose columns are modality-task pairs (TAP's Table 1) takes each cell from the per-pair
table of the column's setup (``pair_table.build_pair_table``): the column's row (``<metric>
<pair>``), the row's method; the same mean ± 95% CI over seeds as that table's (MSE raw with 4
decimals, the others x 100 with 2, the paper's figures alike), with no mark here (that table
sets its Welch test and the test over seeds beside it). A declared pair no run reports is named
below the table with the pairs the runs do report.

A table whose columns are client domains (pFedPG's Table 1) takes each cell from the per-domain
values of the column's setup (``domain_table.build_domain_table``): the row's method over the
column's ``domains`` (the record's: a domain column's own, an ``Average`` column's those of the
domain columns before it), the mean over seeds ± 95% CI of each seed's value, with no mark. A
declared domain no client of the runs has is named below the table with the domains found.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedfm_flower.report.domain_table import DomainTable, domain_cell
from fedfm_flower.report.pair_table import RAW, PairTable, row_name
from fedfm_flower.report.tables import Cell
from fedfm_flower.report.task_table import AVERAGE, UNSEEN_BLOCKS, TaskTable
from fedfm_flower.study.paper_tables import read_table, row_title

Cells = dict[tuple[str, str], Cell]
TaskTables = Mapping[str, TaskTable | None]
PairTables = Mapping[str, PairTable | None]
DomainTables = Mapping[str, DomainTable | None]


def find_table(folders: list[Path]) -> dict[str, Any] | None:
    """The one table record among the report's run folders, or None; ``ValueError`` when they
    hold two different ones."""
    found = {}
    for folder in folders:
        document = read_table(folder) if Path(folder).is_dir() else None
        if document is not None:
            found[(document["key"], document["setting"])] = document
    if len(found) > 1:
        names = ", ".join(f"{k} ({s})" for k, s in found)
        raise ValueError(
            f"the run folders hold {len(found)} tables ({names}): report one at a time"
        )
    return next(iter(found.values()), None)


def _digits(column: dict[str, Any]) -> int:
    """Decimals of a column's figures: 4 for a raw metric's pair (MSE), else 2."""
    pair = column.get("pair")
    return 4 if pair and pair.partition(" ")[0] in RAW else 2


def _paper_figure(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _cell_text(cell: Cell, digits: int) -> str:
    """``Cell.text`` with ``digits`` decimals."""
    spread = f"{cell.ci:.{digits}f}" if len(cell.seeds) > 1 else "—"
    return f"{cell.mean:.{digits}f} ± {spread}{cell.mark}"


def _by_task(document: dict[str, Any]) -> bool:
    """Whether the table's columns are client tasks (a record without the key: setups)."""
    return any(column.get("task") for column in document["columns"])


def _by_pair(document: dict[str, Any]) -> bool:
    """Whether the table's columns are modality-task pairs (a record without the key: not)."""
    return any(column.get("pair") for column in document["columns"])


def domain_columns(document: dict[str, Any]) -> bool:
    """Whether the table's columns are client domains (a record without the key: not)."""
    return any(column.get("domain") for column in document["columns"])


def cell_label(row: dict[str, Any], column_index: int) -> str | None:
    """The row's method on a column (a record without ``labels``: the row's one label)."""
    labels = row.get("labels")
    return labels[column_index] if labels else row["label"]


def _method_text(row: dict[str, Any]) -> str:
    """The row's method labels for the table's method column, each once."""
    labels = dict.fromkeys(label for label in row.get("labels") or [row["label"]] if label)
    return " / ".join(f"`{label}`" for label in labels) or "not here"


def table_cell(
    row: dict[str, Any],
    column: dict[str, Any],
    column_index: int,
    cells: Cells,
    task_tables: TaskTables,
    pair_tables: PairTables | None = None,
    domain_tables: DomainTables | None = None,
) -> Cell | None:
    """Our cell of (row, column, the column's index): the main table's (setup, the row's method on
    the column), for a task column the task
    table's (block, method, task) of the column's setup, for a pair column the pair table's
    (pair row, method), for a domain column the method over its domains; None where there is
    none."""
    label, setup, task = cell_label(row, column_index), column["setup"], column.get("task")
    if not label or not setup:
        return None
    if column.get("domain"):
        by_domain = (domain_tables or {}).get(setup)
        return domain_cell(by_domain, label, column.get("domains") or [])
    if column.get("pair"):
        by_pair = (pair_tables or {}).get(setup)
        metric, _, pair = column["pair"].partition(" ")
        found = None if by_pair is None else by_pair.cells.get((metric, pair), {}).get(label)
        if found is None:
            return None
        return Cell(setup, label, found.seeds, found.mean, found.ci, None)
    if not task:
        return cells.get((setup, label))
    table = task_tables.get(setup)
    if table is None:
        return None
    block = column.get("block") or row.get("block") or ""  # the columns' or else the rows'
    return table.blocks.get(block, {}).get(label, {}).get(task)


def _unknown_tasks(document: dict[str, Any], task_tables: TaskTables) -> list[str]:
    """A line per declared task no client of its setup's runs has (tasks named as found)."""
    lines = []
    for column in document["columns"]:
        table = task_tables.get(column["setup"]) if column.get("task") else None
        if table is None:
            continue
        if column.get("block") in UNSEEN_BLOCKS:
            if column["task"] not in table.unseen_columns:
                found = ", ".join(f"`{c}`" for c in table.unseen_columns) or "none"
                lines.append(
                    f"- {column['name']}: unseen task `{column['task']}` is in no run on "
                    f"`{column['setup']}` (their unseen tasks: {found}); check the table's task "
                    "names and the runs' unseen-test-dir"
                )
        elif column["task"] not in table.columns:
            found = ", ".join(f"`{c}`" for c in table.columns if c != AVERAGE)
            lines.append(
                f"- {column['name']}: task `{column['task']}` is no client's task in the runs "
                f"on `{column['setup']}` (their tasks: {found}); check the table's task names"
            )
    return lines


def _unknown_pairs(document: dict[str, Any], pair_tables: PairTables) -> list[str]:
    """A line per declared pair no run of its setup reports (pairs named as found)."""
    lines = []
    for column in document["columns"]:
        table = pair_tables.get(column["setup"]) if column.get("pair") else None
        if table is not None and tuple(column["pair"].partition(" ")[::2]) not in table.rows:
            found = ", ".join(f"`{row_name(*r)}`" for r in table.rows)
            lines.append(
                f"- {column['name']}: `{column['pair']}` is in no run on `{column['setup']}` "
                f"(their pairs: {found}); check the table's pair names"
            )
    return lines


def _unknown_domains(document: dict[str, Any], domain_tables: DomainTables) -> list[str]:
    """A line per declared domain no client of its setup's runs has (domains named as found)."""
    lines = []
    for column in document["columns"]:
        table = domain_tables.get(column["setup"]) if column.get("domain") else None
        if table is None:
            continue
        for domain in column.get("domains") or []:
            if domain not in table.domains:
                found = ", ".join(f"`{d}`" for d in table.domains)
                lines.append(
                    f"- {column['name']}: domain `{domain}` is no client's domain in the runs "
                    f"on `{column['setup']}` (their domains: {found}); check the table's domain "
                    "names"
                )
    return list(dict.fromkeys(lines))


def markdown_paper_table(
    document: dict[str, Any],
    cells: Cells,
    task_tables: TaskTables | None = None,
    pair_tables: PairTables | None = None,
    domain_tables: DomainTables | None = None,
) -> str:
    """The table in the paper's order; the paper's figures beside ours on its own setting
    (``task_tables``: each setup's per-task table, for a table whose columns are tasks;
    ``pair_tables``: each setup's per-pair table, for a table whose columns are pairs;
    ``domain_tables``: each setup's per-domain values, for a table whose columns are
    domains)."""
    task_tables = task_tables or {}
    pair_tables = pair_tables or {}
    domain_tables = domain_tables or {}
    on_paper = document["setting"] == "paper"
    columns = document["columns"]
    by_task = _by_task(document)
    by_pair = _by_pair(document)
    by_domain = domain_columns(document)
    header, rule = ["row", "method"], ["---", "---"]
    for column in columns:
        if by_domain:
            same = column["domain"] in (column["name"], AVERAGE)
            header.append(column["name"] if same else f"{column['name']} (`{column['domain']}`)")
        elif by_task and column.get("block"):
            what = f"`{column['task']}` of `{column['setup'] or 'no stand-in'}`"
            header.append(f"{column['name']} ({what}, {column['block']})")
        elif by_task:
            same = column["task"] == column["name"]
            header.append(column["name"] if same else f"{column['name']} (`{column['task']}`)")
        elif by_pair:
            header.append(f"{column['name']} (`{column['pair']}`)")
        else:
            setup = f"`{column['setup']}`" if column["setup"] else "no stand-in"
            header.append(f"{column['name']} ({setup})")
        rule.append("---:")
        if on_paper:
            header.append("paper")
            rule.append("---:")
    caption = []
    if by_task:
        setups = dict.fromkeys(f"`{c['setup']}`" if c["setup"] else "no stand-in" for c in columns)
        caption = [
            f"Columns: client tasks of {', '.join(setups)}, as the report's per-task table (a "
            "task: the mean over its clients; Average: the mean over every task of the runs); "
            + (
                "each column at its block."
                if any(c.get("block") for c in columns)
                else "rows under their block."
            )
            + (
                " An unseen task's column (a test-time task outside the federation): AVG, the "
                "mean over the clients of each client's score on it; MAX, the highest client's."
                if any(c.get("block") in UNSEEN_BLOCKS for c in columns)
                else ""
            ),
            "",
        ]
        if all(c.get("block") in UNSEEN_BLOCKS for c in columns):
            caption[0] = (
                f"Columns: test-time tasks outside the federation of {', '.join(setups)}, as "
                "the report's per-task table's unseen blocks: AVG, a seed's mean over the "
                "clients of each client's score on the task; MAX, its highest client's."
            )
    if by_pair:
        setups = dict.fromkeys(f"`{c['setup']}`" if c["setup"] else "no stand-in" for c in columns)
        caption = [
            f"Columns: modality-task pairs of {', '.join(setups)}, as the report's per-pair "
            "table (a seed's value: the mean over the clients holding the pair; its tests "
            "there); MSE raw, lower is better.",
            "",
        ]
    if by_domain:
        setups = dict.fromkeys(f"`{c['setup']}`" if c["setup"] else "no stand-in" for c in columns)
        caption = [
            f"Columns: client domains of {', '.join(setups)} (a seed's value: the mean over the "
            "domain's clients of the final metric; Average: the mean of the domain columns "
            "before it, each domain weighing the same).",
            "",
        ]
    lines = [
        f"## {document['paper']}, {document['table']}: {document['title']}",
        "",
        "Rows and columns in the paper's order; "
        + (
            "ours beside the paper's figures (its own setting)."
            if on_paper
            else "on the offline stand-ins (the paper's figures measure its own setting and "
            "are not set beside these)."
        ),
        "",
        *caption,
        "| " + " | ".join(header) + " |",
        "|" + "|".join(rule) + "|",
    ]
    block = None
    for row in document["rows"]:
        if by_task and row.get("block") and row.get("block") != block:
            block = row.get("block")
            lines.append(f"| *{block}* |" + " |" * (len(header) - 1))
        entries = [row["name"], _method_text(row)]
        for i, column in enumerate(columns):
            cell = table_cell(row, column, i, cells, task_tables, pair_tables, domain_tables)
            digits = _digits(column)
            entries.append(_cell_text(cell, digits) if cell is not None else "—")
            if on_paper:
                entries.append(_paper_figure(row["paper"][i], digits))
        lines.append("| " + " | ".join(entries) + " |")
    missing = [row for row in document["rows"] if row.get("missing")]
    if missing:
        lines += ["", "Rows not run here:"]
        lines += [
            f"- {row_title(row['name'], row.get('block'), row.get('missing-columns') or [])}: "
            f"{row['missing']}"
            for row in missing
        ]
    unknown = _unknown_tasks(document, task_tables)
    if unknown:
        lines += ["", "Columns without a client of their task:", *unknown]
    unknown = _unknown_pairs(document, pair_tables)
    if unknown:
        lines += ["", "Columns without a run of their pair:", *unknown]
    unknown = _unknown_domains(document, domain_tables)
    if unknown:
        lines += ["", "Columns without a client of their domain:", *unknown]
    return "\n".join(lines)


def paper_table_numbers(
    document: dict[str, Any],
    cells: Cells,
    task_tables: TaskTables | None = None,
    pair_tables: PairTables | None = None,
    domain_tables: DomainTables | None = None,
) -> dict[str, Any]:
    """report.json's ``paper-table``: per row and column, ours (mean, ci95, seeds, mark) and the
    paper's figure; a task column also names its ``task``, a row its ``block`` (None where the
    columns name theirs: then each column's cells name it); a pair column its ``pair``; a domain
    column its ``domain`` and the ``domains`` its cell averages."""
    task_tables = task_tables or {}
    by_task, by_pair, by_domain = _by_task(document), _by_pair(document), domain_columns(document)
    rows = []
    for row in document["rows"]:
        entries = {}
        for i, column in enumerate(document["columns"]):
            cell = table_cell(row, column, i, cells, task_tables, pair_tables, domain_tables)
            entries[column["name"]] = {
                "setup": column["setup"],
                **({"task": column["task"]} if by_task else {}),
                **({"block": column["block"]} if column.get("block") else {}),
                **({"pair": column["pair"]} if by_pair else {}),
                **(
                    {"domain": column["domain"], "domains": column.get("domains")}
                    if by_domain
                    else {}
                ),
                "mean": None if cell is None else cell.mean,
                "ci95": None if cell is None or len(cell.seeds) < 2 else cell.ci,
                "seeds": [] if cell is None else list(cell.seeds),
                "mark": "" if cell is None else cell.mark,
                "label": cell_label(row, i),
                "paper": row["paper"][i],
            }
        numbers = {"name": row["name"], "label": row["label"], "cells": entries}
        if by_task:
            numbers["block"] = row.get("block")
        rows.append(numbers)
    return {
        "key": document["key"],
        "setting": document["setting"],
        "paper": document["paper"],
        "table": document["table"],
        "rows": rows,
    }
