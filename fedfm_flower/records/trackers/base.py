"""What every tracker is (``Tracker``) and the values it logs per round (``round_scalars``)."""

from __future__ import annotations

from typing import Any, Protocol


def round_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric top-level values (booleans and the round number left out)."""
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "round"
    }


class Tracker(Protocol):
    """What the runner hands a tracker."""

    def log_round(self, record: dict[str, Any]) -> None:
        """One finished round's record (its numeric values at step ``record['round']``)."""

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The run's summary, once, at the end."""

    def close(self, failed: bool) -> None:
        """Flush and close; ``failed``: the run ended with an error."""
