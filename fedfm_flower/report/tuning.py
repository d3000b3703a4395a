"""The tuning section of a report: what each study searched and tried, what it spent, its
trials and the values chosen, the comparisons whose choice lies outside a rival's trials, and
the choices at an end of their own space (within ``EDGE_SHARE`` of its span, on its scale:
the best value may lie beyond what the space lets the study try, unless that end is the key's
stated limit: ``search.edge_limit``), and how each choice was made
(``fedfm_flower.study.selection``: the candidates re-run at more seeds, those that diverged).

Reads ``tuning.json`` (``fedfm_flower.study.tune``) of a tuning directory given to the report.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedfm_flower.study.search import (
    describe_tried,
    edge_limit,
    outside_tried,
    space_position,
    tried_ranges,
)
from fedfm_flower.study.state import client_round_budgets

EDGE_SHARE = 0.05  # a chosen value this close to an end of its space (share of its span) is flagged


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


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def coverage_flags(studies: list[dict[str, Any]], reference: str) -> dict[str, list[str]]:
    """Per study (by name) of a method other than ``reference``: each key both it and the
    reference's study on its setup searched where one's chosen value lies outside the range
    the other tried (the comparison of the two is then not one of equals on that key)."""
    rivals = {
        s["setup"]: s for s in studies if s["label"] == reference and s.get("chosen") is not None
    }
    flags: dict[str, list[str]] = {}
    for study in studies:
        rival = rivals.get(study["setup"])
        if rival is None or study is rival or study.get("chosen") is None:
            continue
        mine, theirs = tried_ranges(study["trials"]), tried_ranges(rival["trials"])
        chosen, rival_chosen = study["chosen"]["values"], rival["chosen"]["values"]
        said = []
        for key in [k for k in chosen if k in rival_chosen and k in mine and k in theirs]:
            if outside_tried(chosen[key], theirs[key]):
                said.append(
                    f"`{key}` = {_value(chosen[key])} outside {reference}'s tried "
                    f"{describe_tried(theirs[key])}"
                )
            if outside_tried(rival_chosen[key], mine[key]):
                said.append(
                    f"{reference}'s `{key}` = {_value(rival_chosen[key])} outside the tried "
                    f"{describe_tried(mine[key])}"
                )
        flags[study["study"]] = said
    return flags


def edge_flags(studies: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Per study (by name) with chosen values: each numeric key whose chosen value lies within
    ``EDGE_SHARE`` of an end of the space the study searched (an int at 1 at the low end is
    not: nothing lies below it)."""
    flags: dict[str, list[str]] = {}
    for study in studies:
        chosen = study.get("chosen")
        if chosen is None or study.get("values-of"):
            continue
        said = []
        for key, value in chosen["values"].items():
            space = str(study["space"].get(key, ""))
            at = space_position(value, space)
            if at is None or EDGE_SHARE < at < 1 - EDGE_SHARE:
                continue
            if at <= EDGE_SHARE and isinstance(value, int) and value <= 1:
                continue  # a count at 1 (local epochs, steps) has nothing below to try
            end = "bottom" if at <= EDGE_SHARE else "top"
            limit = _limit(study["label"], key, end)
            why = f" (the key's limit: {limit})" if limit else ""
            said.append(f"`{key}` = {_value(value)} at the {end} of {space}{why}")
        flags[study["study"]] = said
    return flags


def _draws(document: dict[str, Any]) -> str:
    """How the final runs drew their data: a clause of the lead sentence."""
    data_seeds = document.get("final-data-seeds")
    if data_seeds is None:  # a command before --data-seeds: see its runs' configs
        return ""
    if len(set(data_seeds)) == 1:
        return f", on one data draw (data seed {data_seeds[0]}): intervals carry training only"
    return (
        f", each on its own data draw (data seeds {', '.join(map(str, data_seeds))}): "
        "intervals carry the partition's variance and training's"
    )


def _score(study: dict[str, Any]) -> str:
    """The chosen trial's validation score: over seeds where selection re-ran it."""
    if study["best-score"] is None:
        return "—"
    single = f"{100 * study['best-score']:.2f}"
    over_seeds = study.get("selection-score")
    if over_seeds is None:
        return single
    runs = next(
        len(c["runs"])
        for c in study["selection"]["candidates"]
        if c["trial"] == study["chosen"]["trial"]
    )
    return f"{100 * over_seeds:.2f} ({runs} seeds; single {single})"


def _selection_lines(study: dict[str, Any]) -> list[str]:
    """The study's selection: each candidate's score over seeds, or where it diverged."""
    selection = study.get("selection")
    if not selection or not selection["candidates"] or selection["top"] == 0:
        return []
    said = []
    for candidate in selection["candidates"]:
        bad = [str(r["seed"]) for r in candidate["runs"] if r["diverged"]]
        if bad:
            said.append(f"trial {candidate['trial']} diverged at seed {', '.join(bad)}")
        else:
            said.append(f"trial {candidate['trial']} {100 * candidate['score']:.2f}")
    passed = selection.get("passed-over") or []
    over = f"; passed over (diverged at the tuning seed): {passed}" if passed else ""
    return [
        f"Selection ({selection['waves']} wave(s), mean over seeds of the last "
        f"{selection['last-rounds']} rounds): " + "; ".join(said) + over + "."
    ]


def _limit(label: str, key: str, end: str) -> str | None:
    """``search.edge_limit``, None for a method no longer registered (an old document)."""
    try:
        return edge_limit(label, key, end)
    except (KeyError, ValueError):
        return None


def markdown_tuning(document: dict[str, Any], reference: str = "") -> str:
    """Per study: its space, what it spent, the ranges it tried, the chosen values (flagged
    where they lie outside the range ``reference``'s study tried, or the reverse), and every
    trial's values and score."""
    first = "; the first at the setup's own values" if document.get("setup-first") else ""
    total = document.get("spent")
    spending = (
        ""
        if total is None
        else f" Spent: {total['trials']} trials ({total['pruned']} pruned), "
        f"{total['client-rounds']} client-rounds, {_duration(total['seconds'])} of rounds, "
        f"{_duration(document.get('wall-seconds', 0.0))} wall time."
    )
    budgets = client_round_budgets(document)
    mixed = len(set(budgets.values())) > 1
    if mixed:  # studies of one directory tuned by commands with different --client-rounds
        topped = (
            " and each study's budget in client-rounds where it has one (its column: spent / "
            "budget; trials drawn past the trial budget until a study spent it)"
        )
    elif any(budgets.values()):
        topped = (
            f" and at least {next(iter(budgets.values()))} client-rounds (trials drawn past the "
            "trial budget until a study spent them)"
        )
    else:
        topped = ""
    flags = coverage_flags(document["studies"], reference) if reference else {}
    edges = edge_flags(document["studies"])
    lines = [
        "## Tuning",
        "",
        f"{document['trials-per-study']} trials{topped} per method x setup ({document['sampler']} "
        f"search, tuning seed {document['tuning-seed']}{first}), each scored by the "
        f"{document['selection']}; the chosen values ran at seeds "
        f"{', '.join(map(str, document['final-seeds']))} on the test split (the tables above)"
        f"{_draws(document)}."
        f"{spending} A client-round is one client's round of one trial; a pruned trial counts "
        "the rounds it ran.",
        "",
        "| method | setup | chosen values | val score | trials (pruned, failed) | client-rounds "
        f"| time | outside {reference or 'the reference'}'s tried range | at an end of its space |",
        "|---|---|---|---|---|---:|---:|---|---|",
    ]
    for study in document["studies"]:
        if study.get("values-of"):  # an ablation run at its method's values: no trials
            lines.append(
                f"| {study['label']} | {study['setup']} | none: the values of "
                f"{study['values-of']} | — | — | — | — | — | — |"
            )
            continue
        chosen = study["chosen"]
        values = (
            "—"
            if chosen is None
            else ", ".join(f"`{k}` = {_value(v)}" for k, v in chosen["values"].items())
        )
        score = _score(study)
        states = [t["state"] for t in study["trials"]]
        cost = study.get("spent")
        client_rounds = "—" if cost is None else str(cost["client-rounds"])
        if mixed and cost is not None:
            client_rounds += f" / {budgets[study['study']] or 'none'}"
        seconds = "—" if cost is None else _duration(cost["seconds"])
        flagged = flags.get(study["study"])
        coverage = "—" if flagged is None else "; ".join(flagged) or "no"
        at_end = edges.get(study["study"])
        edge = "—" if at_end is None else "; ".join(at_end) or "no"
        lines.append(
            f"| {study['label']} | {study['setup']} | {values} | {score} | "
            f"{len(states)} ({states.count('pruned')}, {states.count('fail')}) | "
            f"{client_rounds} | {seconds} | {coverage} | {edge} |"
        )
    for study in document["studies"]:
        if study.get("values-of"):
            continue
        keys = list(study["space"])
        tried = tried_ranges(study["trials"])
        pruner = study.get("pruner", {"name": "none"})
        rungs = (
            ""
            if pruner["name"] == "none"
            else (f" (first rung at round {pruner['min-rounds']}, reduction {pruner['reduction']})")
        )
        lines += [
            "",
            f"### {study['label']} on {study['setup']}",
            "",
            "Space: " + "; ".join(f"`{k}` {rng}" for k, rng in study["space"].items()) + ".",
            "Tried: "
            + ("; ".join(f"`{k}` {describe_tried(t)}" for k, t in tried.items()) or "nothing")
            + f". Pruner: {pruner['name']}{rungs}.",
            *_selection_lines(study),
            "",
            "| trial | " + " | ".join(f"`{k}`" for k in keys) + " | val score | rounds | state |",
            "|---|" + "---|" * len(keys) + "---|---|---|",
        ]
        for trial in study["trials"]:
            cells = [_value(trial["values"].get(k, "")) for k in keys]
            if trial["score"] is not None:
                score = f"{100 * trial['score']:.2f}"
            elif trial.get("last-value") is not None:
                score = f"({100 * trial['last-value']:.2f} at round {trial['last-round']})"
            else:
                score = "—"
            lines.append(
                f"| {trial['number']} | " + " | ".join(cells) + f" | {score} | "
                f"{trial.get('rounds', '—')} | {trial['state']} |"
            )
    return "\n".join(lines)
