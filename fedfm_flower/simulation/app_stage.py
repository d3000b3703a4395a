"""The app's FAB files, copied to a directory that ``flwr run`` builds the FAB from in milliseconds.

``flwr run <app>`` builds the FAB from every file under ``<app>``: Flower's ``collect_files``
walks and resolves each one (the ~65,000 of ``.venv`` included) before it applies
``.gitignore``, 4-6 s on 2 cores before every run. ``stage_app`` walks the app without entering
``.git`` or a directory ``.gitignore`` excludes, keeps what Flower's own publish and FAB rules
keep (``flwr.cli``'s ``filter_paths_for_publish`` and ``get_filtered_fab_paths``, with the
app's ``fab-include``/``fab-exclude``), and copies exactly those files and ``pyproject.toml``.
``flwr run <stage>`` then builds the same FAB, byte for byte (the same hash), as ``flwr run
<app>`` would.

A pruned directory is one whose path ``.gitignore`` matches as a directory; every file under it
is excluded by Flower too. With a negated pattern (``!``) in ``.gitignore`` nothing is pruned.

Imports inside functions keep ``flwr.cli`` out of this module's start-up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def _quiet_pathspec() -> Iterator[None]:
    """Silence the DeprecationWarning of the pathspec pattern class Flower builds with."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def app_files(app_dir: Path) -> dict[str, Path]:
    """Every file under ``app_dir`` outside ``.git`` and the directories .gitignore excludes."""
    from flwr.cli.utils import build_pathspec, load_gitignore_patterns

    gitignore = app_dir / ".gitignore"
    patterns = tuple(load_gitignore_patterns(gitignore.read_bytes())) if gitignore.is_file() else ()
    prune = None
    if not any(p.startswith("!") for p in patterns):
        with _quiet_pathspec():
            prune = build_pathspec(patterns)
    files: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(app_dir, followlinks=False):
        relative = Path(dirpath).relative_to(app_dir)
        dirnames[:] = [
            name
            for name in dirnames
            if name != ".git"
            and not (prune and prune.match_file((relative / name).as_posix() + "/"))
        ]
        for name in filenames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                files[(relative / name).as_posix()] = path
    return files


def fab_paths(app_dir: Path) -> list[str]:
    """The paths, relative to ``app_dir``, of the files Flower packs into its FAB."""
    from flwr.cli.build import get_filtered_fab_paths
    from flwr.cli.utils import filter_paths_for_publish

    config = tomllib.loads((app_dir / "pyproject.toml").read_text())
    with _quiet_pathspec():
        published = filter_paths_for_publish(app_files(app_dir))
        return sorted(get_filtered_fab_paths(published, config))


def stage_app(app_dir: Path, stage: Path) -> Path:
    """Copy ``app_dir``'s FAB files and ``pyproject.toml`` into a fresh ``stage``; return it."""
    app_dir = app_dir.resolve()
    if not (app_dir / "pyproject.toml").is_file():
        raise FileNotFoundError(f"no pyproject.toml in the app directory {app_dir}")
    if stage.exists():
        shutil.rmtree(stage)
    for relative in ["pyproject.toml", *fab_paths(app_dir)]:
        target = stage / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(app_dir / relative, target)
    return stage
