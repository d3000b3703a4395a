"""CPU seconds of a group of processes, summed by role.

Each process keeps the most CPU seen for it, so one that has exited still counts what it used up
to its last sample.
"""

from __future__ import annotations

from fedfm_flower.simulation.processes import cpu_seconds


class CpuByRole:
    """The CPU seconds of every process sampled, under the role it was given."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, float]] = {}  # pid -> (role, most CPU seconds seen)

    def role(self, pid: int) -> str | None:
        """The role ``pid`` was last recorded under, or None if it never was."""
        return self.seen[pid][0] if pid in self.seen else None

    def record(self, pid: int, role: str) -> None:
        """Read ``pid``'s CPU seconds now and keep them under ``role``."""
        before = self.seen.get(pid, (role, 0.0))[1]
        self.seen[pid] = (role, max(cpu_seconds(pid), before))

    def by_role(self) -> dict[str, float]:
        """CPU seconds per role, summed over its processes."""
        totals: dict[str, float] = {}
        for role, seconds in self.seen.values():
            totals[role] = totals.get(role, 0.0) + seconds
        return dict(sorted(totals.items()))

    def processes(self) -> dict[str, int]:
        """How many processes of each role were seen."""
        counts: dict[str, int] = {}
        for role, _ in self.seen.values():
            counts[role] = counts.get(role, 0) + 1
        return dict(sorted(counts.items()))
