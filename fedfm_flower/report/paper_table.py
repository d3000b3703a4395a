"""A paper's table as the paper lays it out: its rows and columns in its order, ours beside its
figures (``fedfm_flower.paper_tables``; the sweep's ``--table`` leaves ``table.json``).

A cell is ours (mean ± 95% CI over seeds, the mark against the report's reference) and, on the
paper's own setting, the paper's figure. On the offline stand-ins the paper's figures measure
another dataset and model, so they are not set beside ours. A row the framework lacks says why;
a row or column without finished runs shows a dash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedfm_flower.paper_tables import read_table
from fedfm_flower.report.tables import Cell


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


def _paper_figure(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def markdown_paper_table(document: dict[str, Any], cells: dict[tuple[str, str], Cell]) -> str:
    """The table in the paper's order; the paper's figures beside ours on its own setting."""
    on_paper = document["setting"] == "paper"
    columns = document["columns"]
    header, rule = ["row", "method"], ["---", "---"]
    for column in columns:
        setup = f"`{column['setup']}`" if column["setup"] else "no stand-in"
        header.append(f"{column['name']} ({setup})")
        rule.append("---:")
        if on_paper:
            header.append("paper")
            rule.append("---:")
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
        "| " + " | ".join(header) + " |",
        "|" + "|".join(rule) + "|",
    ]
    for row in document["rows"]:
        label = row["label"]
        entries = [row["name"], f"`{label}`" if label else "not here"]
        for i, column in enumerate(columns):
            cell = cells.get((column["setup"], label)) if label and column["setup"] else None
            entries.append(cell.text() if cell is not None else "—")
            if on_paper:
                entries.append(_paper_figure(row["paper"][i]))
        lines.append("| " + " | ".join(entries) + " |")
    missing = [row for row in document["rows"] if not row["label"]]
    if missing:
        lines += ["", "Rows not run here:"]
        lines += [f"- {row['name']}: {row['missing']}" for row in missing]
    return "\n".join(lines)


def paper_table_numbers(
    document: dict[str, Any], cells: dict[tuple[str, str], Cell]
) -> dict[str, Any]:
    """report.json's ``paper-table``: per row and column, ours (mean, ci95, seeds, mark) and the
    paper's figure."""
    rows = []
    for row in document["rows"]:
        entries = {}
        for i, column in enumerate(document["columns"]):
            cell = cells.get((column["setup"], row["label"])) if row["label"] else None
            entries[column["name"]] = {
                "setup": column["setup"],
                "mean": None if cell is None else cell.mean,
                "ci95": None if cell is None or len(cell.seeds) < 2 else cell.ci,
                "seeds": [] if cell is None else list(cell.seeds),
                "mark": "" if cell is None else cell.mark,
                "paper": row["paper"][i],
            }
        rows.append({"name": row["name"], "label": row["label"], "cells": entries})
    return {
        "key": document["key"],
        "setting": document["setting"],
        "paper": document["paper"],
        "table": document["table"],
        "rows": rows,
    }
