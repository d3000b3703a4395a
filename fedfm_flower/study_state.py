"""A tuning directory's state that survives a change of machine: small files kept apart.

A tuning command writes its runs (checkpoints and all) under ``--out``; what a later command
needs to resume without repeating work is small: the Optuna journal, ``tuning.json`` and each
finished run's ``config.json``, ``summary.json`` and ``metrics.jsonl``. ``StudyState`` keeps
those under its own root (``--state``, e.g. ``bench/results/<study>/``, a directory that can be
committed), at the same relative paths as under ``--out``. The journal lives there alone; the
other files are copied there as they are written, and copied back into ``--out`` when a command
starts (where ``--out`` lacks them; ``tuning.json`` always): a finished trial is then neither
drawn nor run again, and a finished final run is reused. With the root equal to ``--out`` (the
default) nothing is copied.

Before a command uses them, the files are checked (``check``): a kept JSON file that does not
parse (a merge conflict, a damaged copy) stops the command with an error naming the file and
the line, before anything is run or written. The journal gets one repair: a record cut short by
a write that never finished (a killed process, a commit or copy taken mid-write) is dropped.
Optuna skips such a last record when it reads, but appends the next record to its bytes, which
makes one broken line in the middle of the journal and every later command fail; the cut record
held nothing Optuna had read, so dropping it loses nothing.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfm_flower.durable import atomic_path

log = logging.getLogger(__name__)

JOURNAL = Path("tuning") / "journal.log"
TUNING = Path("tuning.json")
RUN_FILES: tuple[str, ...] = ("config.json", "summary.json", "metrics.jsonl")


@dataclass(frozen=True)
class StudyState:
    """The small files of the tuning directory ``out``, kept under ``root``."""

    out: Path
    root: Path

    @property
    def journal(self) -> Path:
        """The Optuna journal of the directory's studies."""
        return self.root / JOURNAL

    @property
    def apart(self) -> bool:
        """Whether the state is kept outside ``out``."""
        return self.root.resolve() != self.out.resolve()

    def keep(self, path: Path) -> None:
        """Copy ``path`` (a file under ``out``) to the same place under the root."""
        if self.apart and path.is_file():
            _copy(path, self.root / path.resolve().relative_to(self.out.resolve()))

    def keep_run(self, run_dir: Path) -> None:
        """Keep a finished run's small files (nothing of a run without a summary)."""
        if (run_dir / "summary.json").is_file():
            for name in RUN_FILES:
                self.keep(run_dir / name)

    def restore(self) -> list[Path]:
        """Copy into ``out`` every kept file it lacks, and the kept ``tuning.json`` (the
        state's is the newest); not the journal, read in place. The files copied."""
        if not self.apart or not self.root.is_dir():
            return []
        copied = []
        for kept in sorted(self.root.rglob("*")):
            journal = kept.parent == self.journal.parent and kept.name.startswith(JOURNAL.name)
            if not kept.is_file() or journal or kept.name.startswith("."):
                continue
            target = self.out / kept.relative_to(self.root)
            if not target.exists() or target == self.out / TUNING:
                _copy(kept, target)
                copied.append(target)
        return copied

    def check(self) -> None:
        """Refuse (``StateError``) a kept ``tuning.json`` or finished run's file that does not
        parse; drop the journal's record cut short, if any (under Optuna's lock, so no other
        command is writing it)."""
        if not self.root.is_dir():
            return
        read_tuning(self.root / TUNING)
        for summary in sorted(self.root.rglob("summary.json")):
            for name in RUN_FILES:
                kept = summary.parent / name
                if kept.is_file():
                    _parsed_lines(kept, whole=kept.suffix == ".json")
        if self.journal.is_file():
            repair_journal(self.journal)


class StateError(ValueError):
    """A study's state file that cannot be read as written; the message names it and says what
    to do."""


def read_tuning(path: Path) -> dict[str, Any]:
    """The ``tuning.json`` at ``path`` (empty when there is none); ``StateError`` if it does not
    parse or is not an object."""
    if not path.is_file():
        return {}
    (document,) = _parsed_lines(path, whole=True)
    if not isinstance(document, dict):
        raise StateError(f"{path} holds a {type(document).__name__}, not tuning.json's object")
    return document


def repair_journal(path: Path) -> int:
    """Drop the record at the end of the Optuna journal ``path`` that a cut write left without
    its newline; the bytes dropped. ``StateError`` when another line is not a record."""
    from optuna.storages.journal import JournalFileSymlinkLock

    lock = JournalFileSymlinkLock(str(path))
    lock.acquire()
    try:
        data = path.read_bytes()
        complete = data.rfind(b"\n") + 1
        cut = len(data) - complete
        if cut:
            with path.open("r+b") as journal:
                journal.truncate(complete)
                journal.flush()
                os.fsync(journal.fileno())
            log.warning(
                "%s ended in a record cut short (%d bytes, a write that never finished); "
                "dropped it (Optuna never read it)",
                path,
                cut,
            )
    finally:
        lock.release()
    _parsed_lines(path, whole=False)
    return cut


def _parsed_lines(path: Path, whole: bool) -> list[Any]:
    """The JSON value of ``path`` (``whole``) or of each of its non-empty lines; ``StateError``
    naming the file and line of the first that does not parse."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = [text] if whole else text.splitlines()
    values = []
    for number, line in enumerate(lines, start=1):
        if not whole and not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except ValueError as err:
            where = getattr(err, "lineno", number) if whole else number
            raise StateError(
                f"{path}, line {where}: not valid JSON ({err}); a merge conflict or a damaged "
                "copy? Restore the file (e.g. git checkout -- FILE) or remove the bad part; "
                "nothing was run or written"
            ) from None
    return values


def _copy(source: Path, target: Path) -> None:
    """``source``'s bytes to ``target``, atomically."""
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)
