"""FedDPA's Table 1 layout: ROUGE-1 per client task, personalization and test-time blocks.

For the runs of a setup whose final evaluation reports every client's ``test-rouge-1`` (a text
task, ``fedfm_flower.tasks.instructions``), the table has one column per client task plus
``Average`` and two blocks of rows, one row per method:

* *Personalization*: each client's ROUGE-1 on its own task's test split (``rouge-1``);
* *Test-time personalization*: each client's ``ttp-rouge-1``, its model's mean ROUGE-1 over
  every task of the federation, its own included (only runs with ``test-time-evaluation``).

Runs that also answered test-time tasks outside the federation (``unseen-test-dir`` or
``unseen-tasks``: each client's ``unseen-<task>-rouge-1``, ``fedfm_flower.tasks.instructions``)
add two blocks whose columns are those unseen tasks (``unseen_columns``, sorted; no Average),
FedDPA's Table 14: *Unseen tasks (AVG)*, a seed's mean over the run's clients of each client's
ROUGE-1 on the task, and *Unseen tasks (MAX)*, the highest client's. A cell is again the mean
over seeds ± its 95% half-width. The Markdown shows them as a second table under the first.

A column is a client's task. Its task name comes from the run's ``config.json``: a
``client-tasks`` map (partition -> task) when the runner stored one, else from the run config:
``fedfm_flower.data.instructions.client_task`` for dataset ``instructions``, ``client <id>``
for any other. A client's partition is the one its node reported (``summary.json``'s
``client-partitions``); a run without that map takes the client id as the partition (the
default node config, as in simulation). When
several clients share a task (FedDPA's 40-client setting), a seed's value of the column is the
mean over that task's clients. ``Average`` is a seed's mean over the task columns (each task
weighs the same, as in the paper's Average), only for seeds whose run has every task. A cell
is the mean over seeds, in percent, with the half-width of its Student-t 95% interval
(``fedfm_flower.study.statistics.mean_ci``), as in the main table; a seed whose run has no client of
that task does not count in the cell.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfm_flower.data.instructions import client_task
from fedfm_flower.records import protocol as P
from fedfm_flower.records.results import CLIENT_PARTITIONS
from fedfm_flower.report.runs import RunResult
from fedfm_flower.report.tables import Cell
from fedfm_flower.study.statistics import mean_ci

PERSONALIZATION = "rouge-1"
TEST_TIME = "ttp-rouge-1"
BLOCKS: tuple[tuple[str, str], ...] = (
    ("Personalization", PERSONALIZATION),
    ("Test-time personalization", TEST_TIME),
)
UNSEEN_AVG = "Unseen tasks (AVG)"  # blocks of test-time tasks outside the federation
UNSEEN_MAX = "Unseen tasks (MAX)"
UNSEEN_BLOCKS: tuple[str, ...] = (UNSEEN_AVG, UNSEEN_MAX)
AVERAGE = "Average"
STORED_TASKS = "client-tasks"  # optional config.json key: {partition: task name}


@dataclass(frozen=True)
class TaskTable:
    """One setup's table: task columns (then ``Average``) and per block {label: {column: Cell}};
    the unseen blocks' columns are ``unseen_columns``."""

    setup: str
    columns: tuple[str, ...]
    blocks: dict[str, dict[str, dict[str, Cell]]]  # block title -> label -> column -> Cell
    unseen_columns: tuple[str, ...] = ()  # unseen test-time tasks (the UNSEEN_BLOCKS' columns)


def has_rouge(run: RunResult) -> bool:
    """Whether the run's final evaluation has ``test-rouge-1`` for every client."""
    key = P.test_metric(PERSONALIZATION)
    return bool(run.final_metrics) and all(key in m for m in run.final_metrics.values())


def client_partitions(path: Path) -> dict[int, int]:
    """{client id: partition} the run at ``path`` recorded in its summary ({}: none recorded)."""
    summary = path / "summary.json"
    if not summary.is_file():
        return {}
    recorded = json.loads(summary.read_text()).get(CLIENT_PARTITIONS) or {}
    return {int(client): int(partition) for client, partition in recorded.items()}


def stored_by_client(
    path: Path, key: str, clients: Sequence[int]
) -> tuple[dict[int, str], dict[int, int], dict[str, Any]]:
    """({client id: name} of config.json's ``key`` map, which is keyed by partition, for the
    clients it names; {client id: partition}; config.json). A client id is looked up through
    the partition its node reported (the id itself where none was recorded)."""
    payload = json.loads((path / "config.json").read_text())
    stored = {str(k): str(v) for k, v in (payload.get(key) or {}).items()}
    recorded = client_partitions(path)
    partition_of = {client: recorded.get(client, client) for client in clients}
    named = {c: stored[str(p)] for c, p in partition_of.items() if str(p) in stored}
    return named, partition_of, payload


def client_tasks(path: Path, clients: Sequence[int]) -> dict[int, str]:
    """{client id: task name} of the run at ``path`` (stored, else derived from its config)."""
    named, partition_of, payload = stored_by_client(path, STORED_TASKS, clients)
    instructions = payload["run-config"].get("dataset") == "instructions"
    return {
        c: named.get(c) or (client_task(partition_of[c]) if instructions else f"client {c}")
        for c in clients
    }


def task_values(run: RunResult, tasks: dict[int, str], metric: str) -> dict[str, float]:
    """{task: mean over the run's clients of that task of ``metric``} (tasks that have it)."""
    key = P.test_metric(metric)
    by_task: dict[str, list[float]] = {}
    for client in sorted(run.final_metrics):
        if key in run.final_metrics[client]:
            by_task.setdefault(tasks[client], []).append(run.final_metrics[client][key])
    return {task: statistics.fmean(v) for task, v in by_task.items()}


def unseen_values(run: RunResult, block: str) -> dict[str, float]:
    """{unseen task: the mean (``UNSEEN_AVG``) or highest (``UNSEEN_MAX``) over the run's clients
    of their ROUGE-1 on it} (tasks some client answered)."""
    by_task: dict[str, list[float]] = {}
    for client in sorted(run.final_metrics):
        for key, value in run.final_metrics[client].items():
            if (task := P.unseen_task_of(key, PERSONALIZATION)) is not None:
                by_task.setdefault(task, []).append(value)
    aggregate = max if block == UNSEEN_MAX else statistics.fmean
    return {task: aggregate(values) for task, values in by_task.items()}


def build_task_table(
    runs: Sequence[RunResult], setup: str, scale: float = 100.0
) -> TaskTable | None:
    """The table of ``setup`` over its runs with per-client ROUGE-1; None when it has none."""
    chosen = [r for r in runs if r.setup == setup and has_rouge(r)]
    if not chosen:
        return None
    tasks = {run.path: client_tasks(run.path, sorted(run.final_metrics)) for run in chosen}
    first_client: dict[str, int] = {}
    for run in chosen:
        for client, task in tasks[run.path].items():
            first_client[task] = min(client, first_client.get(task, client))
    columns = (*sorted(first_client, key=first_client.__getitem__), AVERAGE)
    grouped: dict[str, dict[int, RunResult]] = {}
    for run in chosen:
        grouped.setdefault(run.label, {})[run.seed] = run
    blocks: dict[str, dict[str, dict[str, Cell]]] = {}
    for title, metric in BLOCKS:
        rows: dict[str, dict[str, Cell]] = {}
        for label, by_seed in grouped.items():
            per_seed = {s: task_values(r, tasks[r.path], metric) for s, r in by_seed.items()}
            for values in per_seed.values():  # only over every task of the table
                if values and all(c in values for c in columns[:-1]):
                    values[AVERAGE] = statistics.fmean(values[c] for c in columns[:-1])
            row = {}
            for column in columns:
                seeds = tuple(s for s in sorted(per_seed) if column in per_seed[s])
                if seeds:
                    mean, ci = mean_ci([scale * per_seed[s][column] for s in seeds])
                    row[column] = Cell(setup, label, seeds, mean, ci, None)
            if row:
                rows[label] = row
        if rows:
            blocks[title] = rows
    unseen: set[str] = set()
    for block in UNSEEN_BLOCKS:
        rows = {}
        for label, by_seed in grouped.items():
            per_seed = {s: unseen_values(r, block) for s, r in by_seed.items()}
            row = {}
            for task in sorted({t for values in per_seed.values() for t in values}):
                seeds = tuple(s for s in sorted(per_seed) if task in per_seed[s])
                mean, ci = mean_ci([scale * per_seed[s][task] for s in seeds])
                row[task] = Cell(setup, label, seeds, mean, ci, None)
            if row:
                rows[label] = row
                unseen |= set(row)
        if rows:
            blocks[block] = rows
    return TaskTable(setup, columns, blocks, tuple(sorted(unseen)))


def markdown_task_table(table: TaskTable) -> str:
    """The table in Markdown: a heading, a caption, block rows then method rows."""
    width = len(table.columns)
    lines = [
        f"### {table.setup}: ROUGE-1 per client task (FedDPA's Table 1 layout)",
        "",
        "Final ROUGE-1 x 100; cells: mean over seeds ± 95% CI half-width (Student t over "
        "seeds). *Personalization*: each client on its own task; *Test-time personalization*: "
        "each client's mean over every task, its own included (`ttp-rouge-1`). A column: the "
        "clients of that task; Average: the mean over the task columns (seeds with every task).",
        "",
        "| method | " + " | ".join(table.columns) + " |",
        "|---|" + "---:|" * width,
    ]
    lines += _block_rows(table, table.columns, [b for b in table.blocks if b not in UNSEEN_BLOCKS])
    if table.unseen_columns:
        lines += [
            "",
            "Test-time tasks outside the federation (FedDPA's Table 14 layout): final ROUGE-1 x "
            "100 of each client's model on each unseen task; AVG: a seed's mean over the "
            "clients, MAX: its highest client; cells as above.",
            "",
            "| method | " + " | ".join(table.unseen_columns) + " |",
            "|---|" + "---:|" * len(table.unseen_columns),
            *_block_rows(
                table, table.unseen_columns, [b for b in UNSEEN_BLOCKS if b in table.blocks]
            ),
        ]
    return "\n".join(lines)


def _block_rows(table: TaskTable, columns: Sequence[str], blocks: Sequence[str]) -> list[str]:
    """Markdown rows of ``blocks`` over ``columns``: a block's title, then its method rows."""
    lines = []
    for title in blocks:
        lines.append(f"| *{title}* |" + " |" * len(columns))
        for label, row in table.blocks[title].items():
            cells = [
                "—" if (cell := row.get(c)) is None else f"{cell.mean:.2f} ± {cell.ci:.2f}"
                for c in columns
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def task_table_numbers(table: TaskTable) -> dict[str, Any]:
    """The table's numbers for ``report.json``: per block, label and column mean, ci95, seeds."""
    return {
        "columns": list(table.columns),
        "unseen-columns": list(table.unseen_columns),
        "blocks": {
            title: {
                label: {
                    column: {"mean": cell.mean, "ci95": cell.ci, "seeds": list(cell.seeds)}
                    for column, cell in row.items()
                }
                for label, row in rows.items()
            }
            for title, rows in table.blocks.items()
        },
    }
