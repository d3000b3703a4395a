"""A serial cell pool for tests of the grid commands: cells queue in order and run, one at a
time, in ``next_done``, by the subclass's ``finish`` (no training: it writes what a run writes)."""

from __future__ import annotations

from typing import Any


class QueuePool:
    """One slot; ``next_done`` hands the oldest cell to ``finish`` and returns its record."""

    def __init__(self) -> None:
        self.queue: list = []
        self.ran: list[str] = []  # run names, in the order they ran

    def capacity(self) -> int:
        return 1

    def submit(self, cell) -> None:  # noqa: ANN001
        self.queue.append(cell)

    def pending(self) -> int:
        return len(self.queue)

    def next_done(self):  # noqa: ANN201
        cell = self.queue.pop(0)
        return cell, self.finish(cell)

    def finish(self, cell) -> dict[str, Any]:  # noqa: ANN001
        """Run (or reuse) ``cell``; its record."""
        raise NotImplementedError

    def close(self) -> None:
        pass
