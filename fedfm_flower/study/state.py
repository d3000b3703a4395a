"""A tuning directory's state that survives a change of machine: small files kept apart.

A tuning command writes its runs (checkpoints and all) under ``--out``; what a later command
needs to resume without repeating work is small: the Optuna journal, ``tuning.json`` and each
finished run's ``config.json``, ``summary.json`` and ``metrics.jsonl`` (a failed run's config
and metrics: the rounds it ran count against the budget). ``StudyState`` keeps
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

The state also keeps the *build* of each offline foundation model its runs used, under
``foundations/`` at the cache's relative paths (``fedfm_flower.models.foundation_cards``: one recipe
gives other weights on another machine, so a key alone does not pin the model). A command
installs the kept builds into the cache before it runs anything (where the cache lacks them;
a cache holding another build of one is refused, naming both), so a study resumed elsewhere
runs on the models its earlier runs ran on; and it refuses a kept final run whose card names
another build than the one kept, so no table pairs runs of one seed made on two models.

Imports inside functions keep ``optuna`` out of this module's start-up.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfm_flower.config.experiment import default_cache_path
from fedfm_flower.models.foundation_cards import (
    CACHE_FILES,
    WEIGHTS_SHA256,
    builds_of,
    describe,
    file_sha256,
    recorded_card,
    same_build,
    weights_file_name,
)
from fedfm_flower.records.durable import atomic_path
from fedfm_flower.study.cells import runs_of

log = logging.getLogger(__name__)

JOURNAL = Path("tuning") / "journal.log"
TUNING = Path("tuning.json")
RUN_FILES: tuple[str, ...] = ("config.json", "summary.json", "metrics.jsonl")
FOUNDATIONS = Path("foundations")  # the builds of the runs' foundation models, as in the cache


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

    def keep_run(self, run_dir: Path, ended: bool = False) -> None:
        """Keep a finished run's small files and the build of its foundation model, if the
        state has none of it yet; with ``ended``, a run that ended without a summary (failed)
        keeps its ``config.json`` and ``metrics.jsonl``, so the rounds it ran still count
        against the budget after a change of machine."""
        if (run_dir / "summary.json").is_file():
            for name in RUN_FILES:
                self.keep(run_dir / name)
            self.keep_foundation(run_dir)
        elif ended:
            for name in RUN_FILES:
                self.keep(run_dir / name)

    def keep_foundation(self, run_dir: Path) -> None:
        """Copy the files of each foundation build the run at ``run_dir`` used from its cache
        into ``foundations/`` (weights last), unless the state keeps that build already."""
        card, run_config = recorded_card(run_dir)
        cache = cache_dir_of(run_config)
        for build in builds_of(card):
            self._keep_build(build, cache, run_dir)

    def _keep_build(self, card: dict[str, Any], cache: Path, run_dir: Path) -> None:
        files = card.get(CACHE_FILES) or []
        if not files or (self.root / FOUNDATIONS / files[0]).is_file():
            return
        sources = [cache / f for f in files]
        if not all(f.is_file() for f in sources):
            log.warning("%s: the foundation's files are not in %s; not kept", run_dir, cache)
            return
        if file_sha256(sources[0]) != card.get(WEIGHTS_SHA256):
            log.warning("%s: the cache holds another build than the run used; not kept", run_dir)
            return
        for source, name in [*zip(sources[1:], files[1:], strict=True), (sources[0], files[0])]:
            _copy(source, self.root / FOUNDATIONS / name)  # the weights last: they say it is whole

    def install_foundations(self, cache: Path) -> list[Path]:
        """Copy every kept foundation build the cache ``cache`` lacks into it (the weights
        last); ``StateError`` naming both when the cache holds another build of one. The
        weights files installed."""
        installed = []
        for weights in sorted((self.root / FOUNDATIONS).rglob("*.safetensors")):
            name = weights.relative_to(self.root / FOUNDATIONS)
            target = cache / name
            if target.is_file():
                if file_sha256(target) != file_sha256(weights):
                    raise StateError(
                        f"the cache's {target} is another build of this foundation than the "
                        f"study keeps ({weights}): one recipe gives other weights on another "
                        "machine, and the study's runs ran on the kept one. Move the cache's "
                        "file away (runs of other studies on this machine that used it then "
                        "use the study's) or give the runs another cache-dir; nothing was run"
                    )
                continue
            stem = weights.with_suffix("")
            companions = [f for f in sorted(weights.parent.rglob("*")) if _belongs(f, stem)]
            for kept in [*companions, weights]:
                _copy(kept, cache / kept.relative_to(self.root / FOUNDATIONS))
            installed.append(target)
        if installed:
            log.info("installed %d kept foundation build(s) into %s", len(installed), cache)
        return installed

    def check_foundations(self) -> None:
        """Refuse (``StateError``) kept final runs whose foundation is another build than the
        one the state keeps (its weights' digest, or for an older card its accuracies)."""
        builds: dict[str, dict[str, Any]] = {}
        for weights in sorted((self.root / FOUNDATIONS).rglob("*.safetensors")):
            card_file = weights.with_suffix(".json")
            card = json.loads(card_file.read_text()) if card_file.is_file() else {}
            builds[weights.name] = {**card, WEIGHTS_SHA256: file_sha256(weights)}
        if not builds:
            return
        other: dict[str, list[str]] = {}
        for config in sorted(runs_of(self.root).glob("*/config.json")):
            run_card, run_config = recorded_card(config.parent)
            for card in builds_of(run_card):
                kept = builds.get(_weights_name(card, run_config))
                if kept is not None and not same_build(card, kept):
                    other.setdefault(describe(kept), []).append(
                        f"{config.parent.name} ({describe(card)})"
                    )
        if other:
            said = "; ".join(f"the kept {k}: {', '.join(v)}" for k, v in other.items())
            raise StateError(
                f"final runs of {self.root} ran on another build of their foundation model "
                f"than the study keeps ({said}). Move those runs away (and their client state, "
                "if there) so they are run again on the kept build; nothing was run"
            )

    def restore(self) -> list[Path]:
        """Copy into ``out`` every kept file it lacks, and the kept ``tuning.json`` (the
        state's is the newest); not the journal, read in place. The files copied."""
        if not self.apart or not self.root.is_dir():
            return []
        copied = []
        for kept in sorted(self.root.rglob("*")):
            journal = kept.parent == self.journal.parent and kept.name.startswith(JOURNAL.name)
            build = kept.is_relative_to(self.root / FOUNDATIONS)  # installed into the cache
            if not kept.is_file() or journal or build or kept.name.startswith("."):
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
        for name in RUN_FILES:  # finished runs' and failed runs' (no summary) files
            for kept in sorted(self.root.rglob(name)):
                if not kept.is_relative_to(self.root / FOUNDATIONS):
                    parsed_lines(kept, whole=kept.suffix == ".json")
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
    (document,) = parsed_lines(path, whole=True)
    if not isinstance(document, dict):
        raise StateError(f"{path} holds a {type(document).__name__}, not tuning.json's object")
    return document


def client_round_budgets(document: dict[str, Any]) -> dict[str, int]:
    """Each tuned study's budget in client-rounds (0: none); a study recorded before budgets
    were kept per study takes the document's ``client-rounds-per-study``."""
    default = int(document.get("client-rounds-per-study") or 0)
    return {
        study["study"]: int(study.get("client-rounds-budget", default) or 0)
        for study in document.get("studies", [])
        if not study.get("values-of")
    }


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
    parsed_lines(path, whole=False)
    return cut


def parsed_lines(path: Path, whole: bool, shown: Path | None = None) -> list[Any]:
    """The JSON value of ``path`` (``whole``) or of each of its non-empty lines; ``StateError``
    naming the file (``shown``, for a copy: the file it copies) and line of the first that
    does not parse."""
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
                f"{shown or path}, line {where}: not valid JSON ({err}); a merge conflict or a "
                "damaged copy? Restore the file (e.g. git checkout -- FILE) or remove the bad "
                "part; nothing was run or written"
            ) from None
    return values


def cache_dir_of(run_config: dict[str, Any]) -> Path:
    """The cache directory of a run config's runs: its ``cache-dir``, else the default."""

    cache_dir = str(run_config.get("cache-dir") or "")
    return Path(cache_dir).expanduser() if cache_dir else default_cache_path()


def _weights_name(card: dict[str, Any], run_config: dict[str, Any]) -> str:
    """The file name of the weights the card names (an older card: the offline ViTs' name)."""
    if card.get(CACHE_FILES):
        return Path(card[CACHE_FILES][0]).name
    if "key" not in card or "backbone" not in run_config:
        return ""
    return weights_file_name(str(run_config["backbone"]), str(card["key"]))


def _belongs(path: Path, stem: Path) -> bool:
    """Whether ``path`` is a companion of the weights ``stem``.safetensors (its card, its
    tokenizer directory's files)."""
    return (
        path.is_file()
        and path.suffix != ".safetensors"
        and (path.with_suffix("") == stem or stem.with_suffix(".tokenizer") in path.parents)
    )


def _copy(source: Path, target: Path) -> None:
    """``source``'s bytes to ``target``, atomically."""
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)
