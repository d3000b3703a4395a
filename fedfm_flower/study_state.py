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
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from fedfm_flower.durable import atomic_path

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


def _copy(source: Path, target: Path) -> None:
    """``source``'s bytes to ``target``, atomically."""
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)
