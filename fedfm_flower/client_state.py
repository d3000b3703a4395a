"""A client's personal state: in ``context.state`` and, with a state directory, on disk.

State is saved per round (``round_00007.safetensors``) and the last ``keep`` rounds are kept.
Training round ``r`` starts from the newest state saved *before* ``r``, and evaluation in round
``r`` uses the newest state saved *at or before* ``r``. That makes replays exact: when a
ServerApp dies after the clients trained round ``k+1`` but before it checkpointed, the resumed
run repeats round ``k+1`` from the clients' round-``k`` state, and no round is counted twice.

Disk files live under ``<state-dir>/<run-name>/client_<id>/``, are written to a temporary file,
fsynced and renamed into place, so a SuperNode killed mid-write never leaves a torn file.
Tensors are stored with safetensors, never pickle.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

import torch
from flwr.app import ConfigRecord, RecordDict
from safetensors.torch import load_file, save_file

from fedfm_flower.records import from_array_record, to_array_record

_ROUND_FILE = re.compile(r"^round_(\d{5,})\.safetensors$")
_STATE_PREFIX = "personal.r"


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
        """Newest state saved before ``before`` (or at or before ``at_most``), or None."""
        limit = (before - 1) if before is not None else at_most
        candidates = [r for r in self.rounds() if limit is None or r <= limit]
        if not candidates:
            return None
        server_round = candidates[-1]
        key = f"{_STATE_PREFIX}{server_round}"
        if key in self._state.array_records:
            tensors = from_array_record(self._state.array_records[key])
        else:
            assert self.directory is not None
            tensors = load_file(self.directory / f"round_{server_round:05d}.safetensors")
            self._state.array_records[key] = to_array_record(tensors)
        self.loaded_round, self.loaded_digest = server_round, state_digest(tensors)
        return tensors

    def save(self, server_round: int, tensors: dict[str, torch.Tensor]) -> None:
        """Save ``tensors`` as the state after ``server_round``; drop states older than keep."""
        cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        self._state.array_records[f"{_STATE_PREFIX}{server_round}"] = to_array_record(cpu)
        self._state.config_records["personal.meta"] = ConfigRecord({"last-round": server_round})
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            target = self.directory / f"round_{server_round:05d}.safetensors"
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            os.close(fd)
            try:
                save_file(cpu, tmp)
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        self._prune()

    def _prune(self) -> None:
        rounds = self.rounds()
        for old in rounds[: max(len(rounds) - self.keep, 0)]:
            self._state.array_records.pop(f"{_STATE_PREFIX}{old}", None)
            if self.directory is not None:
                (self.directory / f"round_{old:05d}.safetensors").unlink(missing_ok=True)


def state_digest(tensors: dict[str, torch.Tensor]) -> int:
    """A 48-bit fingerprint of named tensors (names, dtypes, shapes and values).

    48 bits so that it survives a round trip through a float metric exactly; clients report it
    for the state they resumed from, and tests compare it with the files on disk.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest()[:6], "big")
