"""Files that are complete or absent: atomic, durable writes and verified tensor reads.

``atomic_write_text`` and ``save_tensors`` write to a temporary file in the target directory,
fsync it, rename it into place and fsync the directory; ``atomic_path`` does the same for any
writer (``durable=False`` for caches: no fsync). Every atomic write of the package goes through
``atomic_path``. A file under its final name is therefore always complete. A tensor file also
carries the SHA-256 of its tensors (``tensor_sha256``: names, dtypes, shapes and bytes) in its
safetensors metadata; ``load_tensors`` recomputes it, compares it with that and with a digest
the caller kept elsewhere (a checkpoint's JSON), and raises ``DamagedFileError`` naming the
file when anything does not match or cannot be parsed. Files written before digests existed
(no ``sha256`` metadata) are accepted when they parse.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

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


def load_tensors(path: Path | str, expected_sha256: str | None = None) -> dict[str, torch.Tensor]:
    """Read and verify a tensor file; ``DamagedFileError`` names the file when it is not intact."""
    path = Path(path)
    tensors, stored = _open(path, read_values=True)
    if stored is not None or expected_sha256 is not None:
        actual = tensor_sha256(tensors)
        for source, wanted in (("its own metadata", stored), ("its record", expected_sha256)):
            if wanted is not None and wanted != actual:
                reason = f"tensor digest {actual[:12]}... differs from {wanted[:12]}... in {source}"
                raise DamagedFileError(path, reason)
    return tensors


def _open(path: Path, read_values: bool) -> tuple[dict[str, torch.Tensor], str | None]:
    """(tensors, when ``read_values``, and the stored digest) of a safetensors file."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise DamagedFileError(path, "no such file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            stored = (handle.metadata() or {}).get(DIGEST_KEY)
            names = handle.keys() if read_values else []
            tensors = {name: handle.get_tensor(name) for name in names}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        reason = f"not a readable safetensors file ({path.stat().st_size} bytes): {err}"
        raise DamagedFileError(path, reason) from err
    return tensors, stored
