"""TensorBoard (run-config ``tensorboard = true``): event files under ``<run-dir>/tensorboard``.

Every numeric value of a round's record becomes a scalar at step = round; the summary's numeric
values are scalars ``summary/<key>`` at the last round. View with ``tensorboard --logdir runs``.
Local files only, no account.

Imports inside functions keep ``torch`` out of this module's start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedfm_flower.records.trackers.base import round_scalars

DIRECTORY = "tensorboard"


class TensorBoardLog:
    """Writes round records of one run as TensorBoard scalars."""

    def __init__(self, run_path: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_path / DIRECTORY))
        self.last_round = 0

    def log_round(self, record: dict[str, Any]) -> None:
        """Add the record's scalars at step ``record['round']`` and flush them to disk."""
        self.last_round = int(record["round"])
        for key, value in round_scalars(record).items():
            self.writer.add_scalar(key, value, global_step=self.last_round)
        self.writer.flush()

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The summary's numeric values as scalars ``summary/<key>`` at the last round."""
        for key, value in round_scalars(summary).items():
            self.writer.add_scalar(f"summary/{key}", value, global_step=self.last_round)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        """Flush and close the event file."""
        self.writer.close()
