"""Optional TensorBoard logging of round records (run-config ``tensorboard = true``).

Every numeric top-level value of a round's record (``test-accuracy-mean``, ``train-loss-mean``,
``bytes-up``, ``round-seconds``, ...) becomes a scalar at step = round, in event files under
``<run-dir>/tensorboard``; view them with ``tensorboard --logdir runs``. Local files only, no
account. ``metrics.jsonl`` stays the record of the run; these files are a view of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DIRECTORY = "tensorboard"


def round_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric top-level values (booleans and the round number left out)."""
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "round"
    }


class TensorBoardLog:
    """Writes round records of one run as TensorBoard scalars."""

    def __init__(self, run_path: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_path / DIRECTORY))

    def log_round(self, record: dict[str, Any]) -> None:
        """Add the record's scalars at step ``record['round']`` and flush them to disk."""
        for key, value in round_scalars(record).items():
            self.writer.add_scalar(key, value, global_step=int(record["round"]))
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
