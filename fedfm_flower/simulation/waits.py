"""Waits that grow while nothing happens and start over when something does.

The ServerApp's reply polling (``server_apps.polling``) and the SuperNode's message polling
(``fedfm_flower.deploy.supernode``) both pause between looks: short right after progress,
when the next event is likely near, longer while nothing comes, up to a cap.
"""

from __future__ import annotations


class GrowingWait:
    """Pauses from ``first``, each ``growth`` times the last, capped at ``longest``; an
    iterator of pauses, ``restart`` starts them over."""

    def __init__(self, first: float, longest: float, growth: float = 1.5) -> None:
        self.first, self.longest, self.growth = first, longest, growth
        self.upcoming = first

    def __iter__(self) -> GrowingWait:
        return self

    def __next__(self) -> float:
        pause = self.upcoming
        self.upcoming = min(pause * self.growth, self.longest)
        return pause

    def restart(self) -> None:
        """The next pause is ``first`` again."""
        self.upcoming = self.first
