"""The tuning section of a report: what each study searched, its trials and the values chosen.

Reads ``tuning.json`` (``fedfm_flower.tune``) of a tuning directory given to the report.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def find_tuning(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The ``tuning.json`` documents of the given folders (those that have one)."""
    documents = []
    for path in paths:
        file = path / "tuning.json"
        if file.is_file():
            try:
                documents.append(json.loads(file.read_text()))
            except ValueError as err:
                raise ValueError(f"{file} is not readable JSON: {err}") from err
    return documents


def _value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_tuning(document: dict[str, Any]) -> str:
    """Per study: its space, the chosen values, and every trial's values and score."""
    first = "; the first at the setup's own values" if document.get("setup-first") else ""
    lines = [
        "## Tuning",
        "",
        f"{document['trials-per-study']} trials per method x setup ({document['sampler']} "
        f"search, tuning seed {document['tuning-seed']}{first}), each scored by the "
        f"{document['selection']}; the chosen values ran at seeds "
        f"{', '.join(map(str, document['final-seeds']))} on the test split (the tables above).",
        "",
        "| method | setup | chosen values | val score | trials (failed) |",
        "|---|---|---|---|---|",
    ]
    for study in document["studies"]:
        if study.get("values-of"):  # an ablation run at its method's values: no trials
            lines.append(
                f"| {study['label']} | {study['setup']} | none: the values of "
                f"{study['values-of']} | — | — |"
            )
            continue
        chosen = study["chosen"]
        values = (
            "—"
            if chosen is None
            else ", ".join(f"`{k}` = {_value(v)}" for k, v in chosen["values"].items())
        )
        score = "—" if study["best-score"] is None else f"{100 * study['best-score']:.2f}"
        failed = sum(t["state"] == "fail" for t in study["trials"])
        lines.append(
            f"| {study['label']} | {study['setup']} | {values} | {score} | "
            f"{len(study['trials'])} ({failed}) |"
        )
    for study in document["studies"]:
        if study.get("values-of"):
            continue
        keys = list(study["space"])
        lines += [
            "",
            f"### {study['label']} on {study['setup']}",
            "",
            "Space: " + "; ".join(f"`{k}` {rng}" for k, rng in study["space"].items()) + ".",
            "",
            "| trial | " + " | ".join(f"`{k}`" for k in keys) + " | val score | state |",
            "|---|" + "---|" * len(keys) + "---|---|",
        ]
        for trial in study["trials"]:
            cells = [_value(trial["values"].get(k, "")) for k in keys]
            score = "—" if trial["score"] is None else f"{100 * trial['score']:.2f}"
            lines.append(
                f"| {trial['number']} | " + " | ".join(cells) + f" | {score} | {trial['state']} |"
            )
    return "\n".join(lines)
