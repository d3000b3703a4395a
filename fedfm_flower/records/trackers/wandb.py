"""Weights & Biases (run-config ``wandb = true``): one W&B run per fedfm-flower run.

The W&B run is named after the run directory and its id is derived from the directory's path,
so ``resume = true`` continues the same W&B run (rounds it already has are not logged twice:
W&B drops steps at or below its last one). The run config is the W&B config, each round's
numeric values are logged at step = round, the summary's scalars go to the W&B summary.
``wandb-mode = offline`` writes under ``<run-dir>/wandb`` without a network or an account
(upload later with ``wandb sync``); ``online`` needs ``wandb login`` or ``WANDB_API_KEY``.

Imports inside functions keep ``wandb`` out of this module's start-up.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfm_flower.records.trackers.base import round_scalars

if TYPE_CHECKING:
    from fedfm_flower.config.experiment import ExperimentConfig


def run_id(run_path: Path) -> str:
    """A stable W&B run id for the run directory (16 hex digits of its path's hash)."""
    return hashlib.sha256(str(run_path.resolve()).encode()).hexdigest()[:16]


class WandbLog:
    """Logs one run to W&B."""

    def __init__(self, config: ExperimentConfig, run_path: Path, run_name: str) -> None:
        import wandb

        self.run = wandb.init(
            project=config.wandb_project,
            entity=config.wandb_entity or None,
            name=run_name,
            id=run_id(run_path),
            dir=str(run_path),
            config=config.to_run_config(),
            mode=config.wandb_mode,
            resume="allow",
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )

    def log_round(self, record: dict[str, Any]) -> None:
        """The record's numeric values at step = round."""
        self.run.log(round_scalars(record), step=int(record["round"]))

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The summary's numbers and strings into the W&B run's summary."""
        scalars = {
            k: v for k, v in summary.items() if isinstance(v, int | float | str) and v is not None
        }
        self.run.summary.update(scalars)

    def close(self, failed: bool) -> None:
        """Finish the W&B run (exit code 1 when the run failed)."""
        self.run.finish(exit_code=1 if failed else 0)
