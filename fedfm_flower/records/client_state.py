"""A client's personal state: in ``context.state`` and, with a state directory, on disk.

State is saved per round (``round_00007.safetensors``) and the last ``keep`` rounds are kept.
Training round ``r`` starts from the newest state saved *before* ``r``, and evaluation in round
``r`` uses the newest state saved *at or before* ``r``. That makes replays exact: when a
ServerApp dies after the clients trained round ``k+1`` but before it checkpointed, the resumed
run repeats round ``k+1`` from the clients' round-``k`` state, and no round is counted twice.

Disk files live under ``<state-dir>/<run-name>/client_<id>/``, are written to a temporary file,
fsynced and renamed into place, so a SuperNode killed mid-write never leaves a torn file, and
carry the digest of their tensors (``fedfm_flower.records.durable``). A file that fails to read or
to verify (a damaged disk, a copy cut short) is skipped with a warning naming it, and the newest
intact older state is used instead. Tensors are stored with safetensors, never pickle. The
temporary file of a write that a kill cut short (``.round_00007.safetensors.<random>.tmp``) is
left behind; the next save of a later round removes such leftovers of older rounds (no writer of
an older round can still be running by then: one client is one ClientApp at a time).

The store keeps ``keep`` rounds; clients keep one more than the server keeps checkpoints
(``ClientRuntime``), because the newest client state may belong to a round the server never
committed: a resume that falls back past a damaged server checkpoint still finds the client
state it needs.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from flwr.app import ConfigRecord, RecordDict

from fedfm_flower.records.durable import DamagedFileError, load_tensors, save_tensors, tensor_sha256
from fedfm_flower.records.messages import from_array_record, to_array_record

_ROUND_FILE = re.compile(r"^round_(\d{5,})\.safetensors$")
_TEMP_FILE = re.compile(r"^\.round_(\d{5,})\.safetensors\..*\.tmp$")  # durable.atomic_path's
_STATE_PREFIX = "personal.r"

log = logging.getLogger(__name__)


class ClientStateStore:
    """Per-round personal tensors of one client, in memory and optionally on disk."""

    def __init__(
        self, state: RecordDict, client_id: int, run_name: str, state_dir: str = "", keep: int = 2
    ) -> None:
        self._state = state
        self.keep = keep
        self.loaded_round = 0  # round of the state the last ``load`` returned (0: none)
        self.loaded_digest = 0  # its ``state_digest`` (0: none)
        self.directory: Path | None = None
        # How a round's file is written (fault injection stalls it: client_apps.faults).
        self.write_file: Callable[[Path, dict[str, torch.Tensor]], object] = save_tensors
        if state_dir:
            safe_run = re.sub(r"[^A-Za-z0-9_.-]", "_", run_name or "default")
            self.directory = Path(state_dir).expanduser() / safe_run / f"client_{client_id}"

    def rounds(self) -> list[int]:
        """Rounds with saved state, oldest first (memory and disk together)."""
        found = {
            int(key[len(_STATE_PREFIX) :])
            for key in self._state.array_records
            if key.startswith(_STATE_PREFIX)
        }
        if self.directory is not None and self.directory.is_dir():
            for path in self.directory.iterdir():
                match = _ROUND_FILE.match(path.name)
                if match:
                    found.add(int(match.group(1)))
        return sorted(found)

    def load(
        self, *, before: int | None = None, at_most: int | None = None
    ) -> dict[str, torch.Tensor] | None:
        """Newest intact state saved before ``before`` (or at or before ``at_most``), or None.

        A damaged file is skipped with a warning that names it; the next older state is used.
        """
        limit = (before - 1) if before is not None else at_most
        candidates = [r for r in self.rounds() if limit is None or r <= limit]
        for server_round in reversed(candidates):
            key = f"{_STATE_PREFIX}{server_round}"
            if key in self._state.array_records:
                tensors = from_array_record(self._state.array_records[key])
            else:
                assert self.directory is not None
                try:
                    path = self.directory / f"round_{server_round:05d}.safetensors"
                    tensors = load_tensors(path, own=True)
                except DamagedFileError as err:
                    log.warning(
                        "personal state of round %d is damaged (%s); using an older one",
                        server_round,
                        err,
                    )
                    continue
                self._state.array_records[key] = to_array_record(tensors)
            self.loaded_round, self.loaded_digest = server_round, state_digest(tensors)
            return tensors
        return None

    def forget_loaded(self) -> None:
        """Clear ``loaded_round``/``loaded_digest``: the next ``load`` alone sets them (a fused
        message evaluates, then trains, and reports the state training started from)."""
        self.loaded_round = 0
        self.loaded_digest = 0

    def save(self, server_round: int, tensors: dict[str, torch.Tensor]) -> None:
        """Save ``tensors`` as the state after ``server_round``; drop states older than keep."""
        cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        self._state.array_records[f"{_STATE_PREFIX}{server_round}"] = to_array_record(cpu)
        self._state.config_records["personal.meta"] = ConfigRecord({"last-round": server_round})
        if self.directory is not None:
            self.write_file(self.directory / f"round_{server_round:05d}.safetensors", cpu)
            self._remove_leftovers(server_round)
        self._prune()

    def _remove_leftovers(self, server_round: int) -> None:
        assert self.directory is not None
        for path in self.directory.iterdir():
            match = _TEMP_FILE.match(path.name)
            if match and int(match.group(1)) < server_round:
                log.info("removing %s, left by a write that did not finish", path.name)
                path.unlink(missing_ok=True)

    def _prune(self) -> None:
        rounds = self.rounds()
        for old in rounds[: max(len(rounds) - self.keep, 0)]:
            self._state.array_records.pop(f"{_STATE_PREFIX}{old}", None)
            if self.directory is not None:
                (self.directory / f"round_{old:05d}.safetensors").unlink(missing_ok=True)


def state_digest(tensors: dict[str, torch.Tensor]) -> int:
    """A 48-bit fingerprint of named tensors: the first 48 bits of their ``tensor_sha256``.

    48 bits so that it survives a round trip through a float metric exactly; clients report it
    for the state they resumed from, and tests compare it with the files on disk.
    """
    return int(tensor_sha256(tensors)[:12], 16)
