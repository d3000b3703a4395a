"""A cell: one run of a grid (a method label, a setup, a seed and its run config), and running it.

``cell_record`` runs (or resumes, or reuses) a cell in this process and says how it went; the
sweep, the tuning command and every pool (``fedfm_flower.study.pools``) run cells through it.

Imports inside functions keep ``flwr.app``, ``flwr.clientapp`` and ``flwr.serverapp`` out of
this module's start-up.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfm_flower.records.results import RunDirectory

if TYPE_CHECKING:
    from fedfm_flower.study.pruning import TrialLink


TRANSFER_MARK = "~"  # a transfer setup's name: <base setup>~<transfer name>


def runs_of(out: Path) -> Path:
    """The folder of a grid directory's run directories (a tuning directory's final runs; its
    trials' are ``runs_of(out / "tuning")``)."""
    return out / "runs"


@dataclass(frozen=True)
class Cell:
    """One run of a grid: a method label, a setup, a seed and its full run config."""

    label: str  # method or method:variant
    setup: str
    seed: int
    config: dict[str, Any]
    trial: TrialLink | None = None  # a tuning trial's: its run reports to the trial, may stop

    @property
    def run_dir(self) -> Path:
        """Where the run writes its results."""
        return Path(self.config["output-dir"]) / self.config["run-name"]

    @property
    def kind(self) -> str:
        """What the cells of about the same cost share (progress estimates): label and setup."""
        return cell_kind(self.label, self.setup)


def cell_kind(label: str, setup: str) -> str:
    """The kind of the cells of ``label`` on ``setup`` (``Cell.kind``)."""
    return f"{label} {setup}"


def cell_state(cell: Cell) -> str:
    """'done' (summary written), 'interrupted' (a checkpoint to resume from) or 'new'."""

    if (cell.run_dir / "summary.json").is_file():
        return "done"
    if RunDirectory(cell.run_dir).checkpoint_rounds():
        return "interrupted"
    return "new"


def run_cell(cell: Cell) -> dict[str, Any]:
    """Run (or resume, or reuse) one cell checked by ``sweep.check_configs``; its summary."""
    state = cell_state(cell)
    if state == "done":
        return json.loads((cell.run_dir / "summary.json").read_text())
    from server_apps.inprocess import run_in_process

    config = dict(cell.config)
    if state == "interrupted":
        config["resume"] = True
    elif cell.run_dir.exists():
        shutil.rmtree(cell.run_dir)  # started but never checkpointed: start it over
    early_stop = cell.trial.early_stop() if cell.trial is not None else None
    summary, _ = run_in_process(  # num-clients set: sweep.check_configs
        config, int(config["num-clients"]), early_stop=early_stop
    )
    return summary


def _identity(cell: Cell) -> dict[str, Any]:
    return {"label": cell.label, "setup": cell.setup, "seed": cell.seed, "run": str(cell.run_dir)}


def failed_record(cell: Cell, error: str) -> dict[str, Any]:
    """The record of a cell that did not finish (``error`` says why)."""
    return {**_identity(cell), "state": "failed", "error": error[:2000]}


def cell_record(cell: Cell) -> dict[str, Any]:
    """Run (or resume, or reuse) ``cell``; its record: state before and after, the final value
    of its primary metric, its seconds, or the error that stopped it."""
    record = {**_identity(cell), "state-before": cell_state(cell)}
    started = time.perf_counter()
    try:
        summary = run_cell(cell)
    except Exception as err:  # noqa: BLE001 - report it, run the other cells
        record.update(failed_record(cell, f"{type(err).__name__}: {err}"))
    else:
        metric = summary.get("primary-metric", "accuracy")
        value = summary.get(f"final-test-{metric}-mean", float("nan"))
        record.update(state="done", metric=metric, final=value)
        if "stopped-at-round" in summary:  # a pruned trial: ``final`` is its last value
            record["stopped-at-round"] = summary["stopped-at-round"]
    record["seconds"] = time.perf_counter() - started
    return record
