"""Files that are complete or absent: atomic, durable writes and verified tensor reads.

``atomic_write_text`` and ``save_tensors`` write to a temporary file in the target directory,
fsync it, rename it into place and fsync the directory; ``atomic_path`` does the same for any
writer (``durable=False`` for caches: no fsync). Every atomic write of the package goes through
``atomic_path``. A file under its final name is therefore always complete. A tensor file also
carries the SHA-256 of its tensors (``tensor_sha256``: names, dtypes, shapes and bytes) in its
safetensors metadata; ``load_tensors`` recomputes it, compares it with that and with a digest
the caller kept elsewhere (a checkpoint's JSON), and raises ``DamagedFileError`` naming the
file when anything does not match or cannot be parsed. Files written before digests existed
(no metadata at all) are accepted when they parse; a file of this package's (``own``) whose
metadata lacks the digest has lost it (a damaged key) and is refused.

A JSON document that a resume trusts (a checkpoint's record, the privacy ledger) is *sealed*:
written with the SHA-256 of its canonical form (sorted keys) under a key of its own
(``sealed_json``), and read back only when it still hashes to it (``read_sealed_json``); a
flipped bit in a key, a number or a flag is then a ``DamagedFileError`` naming the file, not
a silently different record. A document written before seals existed is accepted when its
keys are the ones such documents had.

Imports inside functions keep ``safetensors`` and ``torch`` out of this module's start-up.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads inside the tensor functions: the launcher's checks need none
    import torch

DIGEST_KEY = "sha256"  # safetensors metadata key of the tensors' digest


class DamagedFileError(OSError):
    """A tensor file that is missing, truncated, unparsable or fails its digest."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


def tensor_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """Hex SHA-256 of named tensors: for each name in sorted order, name, dtype, shape, bytes."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path, durable: bool = True) -> Iterator[Path]:
    """A temporary file beside ``path`` to write; on success it is fsynced and renamed onto
    ``path`` (and the directory fsynced), on failure removed.

    ``durable=False`` skips both fsyncs, for files that are only a cache or throwaway output:
    the rename still means no process ever sees a partial file, but after a power loss the file
    may be empty or gone, so its reader must treat an unreadable file as missing. A file that
    is replaced keeps its permission bits; a new one is readable by its owner only.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with contextlib.suppress(FileNotFoundError):
        os.fchmod(fd, stat.S_IMODE(os.stat(path).st_mode))
    os.close(fd)
    try:
        yield Path(tmp)
        if durable:
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    if durable:
        fsync_directory(path.parent)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` (created if missing): one process at a
    time between enter and exit."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def atomic_write_text(path: Path | str, text: str, durable: bool = True) -> None:
    """Write ``text`` to ``path`` atomically and (unless ``durable=False``) durably."""
    with atomic_path(Path(path), durable) as tmp:
        tmp.write_text(text)


def save_tensors(path: Path | str, tensors: dict[str, torch.Tensor]) -> str:
    """Write ``tensors`` to ``path`` atomically and durably; returns their ``tensor_sha256``."""
    from safetensors.torch import save_file

    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    digest = tensor_sha256(cpu)
    with atomic_path(Path(path)) as tmp:
        save_file(cpu, str(tmp), metadata={DIGEST_KEY: digest})
    return digest


def check_tensor_file(path: Path | str) -> None:
    """Parse a tensor file's header and size only (cheap for large weights); ``DamagedFileError``
    names the file when that fails. ``load_tensors`` verifies the values too."""
    _open(Path(path), read_values=False)


def load_tensors(
    path: Path | str, expected_sha256: str | None = None, own: bool = False
) -> dict[str, torch.Tensor]:
    """Read and verify a tensor file; ``DamagedFileError`` names the file when it is not intact.

    ``own``: the file was written by ``save_tensors`` (checkpoints, client state), so metadata
    without the digest is damage, not another writer's file (a user's weights may carry other
    metadata and no digest)."""
    path = Path(path)
    tensors, stored = _open(path, read_values=True, own=own)
    if stored is not None or expected_sha256 is not None:
        actual = tensor_sha256(tensors)
        for source, wanted in (("its own metadata", stored), ("its record", expected_sha256)):
            if wanted is not None and wanted != actual:
                reason = f"tensor digest {actual[:12]}... differs from {wanted[:12]}... in {source}"
                raise DamagedFileError(path, reason)
    return tensors


def _open(
    path: Path, read_values: bool, own: bool = False
) -> tuple[dict[str, torch.Tensor], str | None]:
    """(tensors, when ``read_values``, and the stored digest) of a safetensors file."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise DamagedFileError(path, "no such file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            names = handle.keys() if read_values else []
            tensors = {name: handle.get_tensor(name) for name in names}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        reason = f"not a readable safetensors file ({path.stat().st_size} bytes): {err}"
        raise DamagedFileError(path, reason) from err
    if own and metadata and DIGEST_KEY not in metadata:
        reason = f"metadata without its {DIGEST_KEY!r} (keys {sorted(metadata)[:3]})"
        raise DamagedFileError(path, reason)
    return tensors, metadata.get(DIGEST_KEY)


def json_sha256(document: dict[str, Any]) -> str:
    """Hex SHA-256 of ``document`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def sealed_json(document: dict[str, Any], seal: str) -> str:
    """``document`` as JSON with its ``json_sha256`` under the key ``seal``."""
    if seal in document:
        raise ValueError(f"a document to seal must not hold the key {seal!r}")
    return json.dumps({**document, seal: json_sha256(document)})


def read_sealed_json(path: Path | str, seal: str, legacy_keys: frozenset[str]) -> dict[str, Any]:
    """The JSON object in ``path`` written by ``sealed_json(..., seal)``, without its seal;
    ``DamagedFileError`` naming the file when it cannot be read or parsed, is not an object,
    or does not hash to its seal. An object without a seal (written before seals existed) is
    accepted when its keys are among ``legacy_keys``."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError included
        raise DamagedFileError(path, f"unreadable JSON: {err}") from err
    if not isinstance(document, dict):
        raise DamagedFileError(path, f"holds a JSON {type(document).__name__}, not an object")
    if seal not in document:
        unknown = sorted(set(document) - legacy_keys)
        if unknown:
            raise DamagedFileError(path, f"no {seal!r} and unknown keys {unknown[:3]}")
        return document
    stored = document.pop(seal)
    actual = json_sha256(document)
    if stored != actual:
        raise DamagedFileError(path, f"content digest {actual[:12]}... differs from {stored!r}")
    return document
