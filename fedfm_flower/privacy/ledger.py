"""The privacy ledger of a run: every DP release counted once, on disk before it can leave.

A *release* is one use of the Gaussian mechanism whose output may reach another party:

* central DP: a round's noised average (``strategies.parts.averaging.DPFedAvg``); it leaves in
  the round's evaluation messages or the next round's training messages;
* local DP: a round's training dispatch (``strategies.parts.accounting.LocalReleases``, when
  ``configure_train`` builds the messages); each sampled client answers with at most one
  noised update, so the count bounds every client's.

The noise is fresh per release (``privacy.noise``), so a round redone after a crash is a new
release, not a replay of the old one, and counts again. The strategy's release accounting
(``strategies.parts.accounting``) records releases in its ``ReleaseLedger`` (checkpointed in
its state's metadata, with the noise source); the runner writes the ledger to ``privacy.json``
in the run directory (``LedgerFile``, atomic) after building a round's messages and after
aggregating, before anything goes out. A crash between a
release and the round's checkpoint therefore loses no count: a resumed run takes the ledger on
disk, which holds the checkpoint's releases and those made after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfm_flower.privacy.noise import NOISE_SOURCE
from fedfm_flower.records.durable import (
    DamagedFileError,
    atomic_write_text,
    read_sealed_json,
    sealed_json,
)

LEDGER_FILE = "privacy.json"
LEDGER_SEAL = "sha256"  # privacy.json's seal (durable.sealed_json)
UNSEALED_LEDGER_KEYS = frozenset({"mode", "noise", "releases"})  # what it held before seals

log = logging.getLogger(__name__)


@dataclass
class ReleaseLedger:
    """The rounds of a run's DP releases, in order (a round redone after a crash appears again),
    the DP mode and the noise source they were drawn from."""

    mode: str
    rounds: list[int] = field(default_factory=list)
    noise: str = NOISE_SOURCE

    @property
    def count(self) -> int:
        """Releases made so far."""
        return len(self.rounds)

    def record(self, server_round: int) -> None:
        """Count one release in ``server_round``."""
        self.rounds.append(server_round)

    def to_json(self) -> dict[str, Any]:
        """The ledger as JSON (what checkpoints and ``privacy.json`` hold)."""
        return {"mode": self.mode, "noise": self.noise, "releases": list(self.rounds)}

    @classmethod
    def from_json(cls, data: Any, mode: str, source: str) -> ReleaseLedger:
        """The ledger ``to_json`` wrote, for a run in DP ``mode``; ``ValueError`` naming
        ``source`` for a ledger of another mode, of noise that was not fresh, or malformed."""
        if not isinstance(data, dict):
            raise ValueError(
                f"{source}: holds no privacy ledger, so its DP noise was not fresh (it was "
                "derived from the run seed, which anyone can regenerate) or it is not a DP "
                "run's: start a new run (another run-name)"
            )
        if data.get("noise") != NOISE_SOURCE:
            raise ValueError(
                f"{source}: the DP noise of its releases was {data.get('noise')!r}, not fresh "
                f"{NOISE_SOURCE!r} noise; noise derived from the run seed can be regenerated, "
                "so those releases protect nothing: start a new run (another run-name)"
            )
        if data.get("mode") != mode:
            raise ValueError(f"{source}: a ledger of dp = {data.get('mode')!r}, not {mode!r}")
        rounds = data.get("releases")
        if not isinstance(rounds, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in rounds
        ):
            raise ValueError(f"{source}: 'releases' must be a list of round numbers >= 1")
        return cls(mode, list(rounds))

    def absorb(self, written: ReleaseLedger) -> None:
        """Take the releases of ``written``, the ledger on disk (resume): written ahead of the
        checkpoint this ledger comes from, it begins with this one's releases and may hold
        some made after it (a shorter one that this one begins with changes nothing)."""
        if self.rounds[: written.count] == written.rounds:
            return
        if written.rounds[: self.count] != self.rounds:
            raise ValueError(
                f"the privacy ledger on disk (releases in rounds {written.rounds}) and the "
                f"checkpoint's ({self.rounds}) disagree: they belong to different runs"
            )
        log.warning(
            "%d DP release(s) after the checkpoint (rounds %s) count again: the noise is "
            "fresh, so a redone round is a new release",
            written.count - self.count,
            written.rounds[self.count :],
        )
        self.rounds = list(written.rounds)


class LedgerFile:
    """``privacy.json`` of a run directory, rewritten (atomically, durably) whenever the
    ledger it keeps has grown."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LEDGER_FILE
        self.written = -1

    def read(self, mode: str) -> ReleaseLedger | None:
        """The ledger on disk (None: none yet); ``DamagedFileError`` when it is unreadable."""
        if not self.path.exists():
            return None
        try:
            data = read_sealed_json(self.path, LEDGER_SEAL, UNSEALED_LEDGER_KEYS)
            ledger = ReleaseLedger.from_json(data, mode, str(self.path))
        except DamagedFileError as err:
            raise DamagedFileError(self.path, f"unusable privacy ledger: {err.reason}") from err
        except ValueError as err:
            raise DamagedFileError(self.path, f"unusable privacy ledger: {err}") from err
        self.written = ledger.count
        return ledger

    def keep(self, ledger: ReleaseLedger) -> None:
        """Write ``ledger`` when it holds releases not yet on disk."""
        if ledger.count == self.written:
            return
        atomic_write_text(self.path, sealed_json(ledger.to_json(), LEDGER_SEAL))
        self.written = ledger.count
