"""``flower-superlink`` whose SQLite state holds under many SuperNodes, and that answers for
the messages a restarted SuperNode lost (``fedfm_flower.deploy.restarted_nodes``).

    python -m fedfm_flower.deploy.superlink [--lock-wait 60] <flower-superlink arguments>

Flower's SuperLink (1.41, 1.42) keeps its state in SQLite (``--database FILE``) in one process
whose request threads share the file. Under load two of its settings fail requests:

* every connection waits at most 5 s for SQLite's write lock (``busy_timeout`` 5000 in
  ``flwr.supercore.sql_mixin.SQLITE_PRAGMAS``), then the request fails with ``database is
  locked``. With 30 SuperNodes on 2 cores a thread that holds the lock waits for the GIL among
  ~40 busy request threads for longer than that. A SuperNode's failed request is retried
  (``fedfm_flower.deploy.supernode``), but a ServerApp whose object the SuperLink did not
  store fails its run (seen at 30 nodes, round 2);
* every read of a run's status or a task's claim first sweeps expired task tokens
  (``SqlCoreState._cleanup_expired_task_tokens``): two ``UPDATE`` statements, so a write
  transaction, for every object a SuperNode or the ServerApp pushes (py-spy at 30 nodes: a
  quarter of the SuperLink's samples, most of it waiting for the lock or a pooled connection).

Here each connection waits up to ``--lock-wait`` seconds (default ``DEFAULT_LOCK_WAIT_S``)
for the lock (``wait_longer_for_locks``), and the sweep runs at most once every
``SWEEP_EVERY_S`` seconds per state (``sweep_tokens_at_most_every``): a task whose token
expired is found at most that much later, against token lifetimes of tens of seconds. What the
sweep does, and everything else, is Flower's. Both apply only to the Flower versions and the
sweep's source this was written against (``FLOWER_SOURCES``); elsewhere the SuperLink runs
with Flower's settings and says so on stderr.

Imports inside functions keep ``flwr.superlink`` out of this module's start-up.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedfm_flower.deploy.known_flower import flower_version, is_known, refuse
from fedfm_flower.deploy.restarted_nodes import answer_for_restarted_nodes
from fedfm_flower.simulation.prompt_engine import source_digest

PRAGMAS_MODULE = "flwr.supercore.sql_mixin"
STATE_MODULE = "flwr.supercore.corestate.sql_corestate"
SWEEP = "_cleanup_expired_task_tokens"
DEFAULT_LOCK_WAIT_S = 60.0
SWEEP_EVERY_S = 1.0
# sha256 (first 16 hex digits) of inspect.getsource of the sweep, on the versions above.
FLOWER_SOURCES = {SWEEP: {"34301eae2ee4a008"}}
_SWEEP_LOCK = threading.Lock()
WHO = "fedfm_flower.deploy.superlink"


def check_lock_wait(seconds: float) -> float:
    """``seconds`` if usable as SQLite's lock wait (1 s to 1 h), else ValueError naming it."""
    if not (math.isfinite(seconds) and 1.0 <= seconds <= 3600.0):
        raise ValueError(f"lock wait must be a number of seconds in [1, 3600], got {seconds!r}")
    return seconds


def wait_longer_for_locks(seconds: float = DEFAULT_LOCK_WAIT_S) -> bool:
    """Make every SQLite connection the SuperLink opens from now on wait up to ``seconds`` for
    the write lock; False, changing nothing, on a Flower this was not written against."""
    check_lock_wait(seconds)
    module = importlib.import_module(PRAGMAS_MODULE)
    pragmas = getattr(module, "SQLITE_PRAGMAS", None)
    known = isinstance(pragmas, tuple) and any(
        isinstance(p, tuple) and p[:1] == ("busy_timeout",) for p in pragmas
    )
    if not is_known(flower_version()) or not known:
        return refuse(WHO, "SQLite settings", "SQLite waits 5 s for its lock")
    module.SQLITE_PRAGMAS = tuple(
        ("busy_timeout", str(round(seconds * 1000))) if name == "busy_timeout" else (name, value)
        for name, value in pragmas
    )
    return True


def _sweeping_at_most_every(sweep: Callable[[Any], None], seconds: float) -> Callable:
    """``sweep`` (a state's method) that returns at once when the same state swept less than
    ``seconds`` ago."""

    @functools.wraps(sweep)
    def sweep_now_and_then(self: Any) -> None:
        now = time.monotonic()
        with _SWEEP_LOCK:
            last = self.__dict__.get("_fedfm_last_sweep")
            if last is not None and now - last < seconds:
                return
            self.__dict__["_fedfm_last_sweep"] = now
        sweep(self)

    sweep_now_and_then.sweep_every_s = seconds  # type: ignore[attr-defined]
    return sweep_now_and_then


def sweep_tokens_at_most_every(seconds: float = SWEEP_EVERY_S) -> bool:
    """Let the SQLite state sweep expired task tokens at most once every ``seconds`` (module
    doc); False, changing nothing, on a Flower whose sweep this was not written against."""

    state = getattr(importlib.import_module(STATE_MODULE), "SqlCoreState", None)
    sweep = getattr(state, SWEEP, None)
    original = getattr(sweep, "__wrapped__", sweep)
    if (
        not is_known(flower_version())
        or original is None
        or source_digest(original) not in FLOWER_SOURCES[SWEEP]
    ):
        return refuse(WHO, "task-token sweep", "it sweeps on every status read")
    setattr(state, SWEEP, _sweeping_at_most_every(original, seconds))
    return True


def make_database_directory(arguments: Sequence[str]) -> Path | None:
    """Create the directory of ``--database FILE`` among Flower's ``arguments`` (SQLite cannot
    open a file in a directory that does not exist); the directory, or None without one."""
    database = None
    for i, argument in enumerate(arguments):
        if argument == "--database" and i + 1 < len(arguments):
            database = arguments[i + 1]
        elif argument.startswith("--database="):
            database = argument.split("=", 1)[1]
    if not database or database.startswith(":"):  # Flower's :flwr-in-memory: and SQLite's
        return None
    directory = Path(database).expanduser().parent
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``--lock-wait``, apply the changes, then run ``flower-superlink`` on the rest."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.deploy.superlink",
        description=__doc__.splitlines()[0],
        epilog="Every other argument goes to flower-superlink unchanged.",
    )
    parser.add_argument(
        "--lock-wait",
        type=float,
        default=DEFAULT_LOCK_WAIT_S,
        help=f"seconds a request waits for SQLite's write lock (default {DEFAULT_LOCK_WAIT_S:g})",
    )
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    try:
        check_lock_wait(args.lock_wait)
    except ValueError as err:
        parser.error(f"--lock-wait: {err}")
    wait_longer_for_locks(args.lock_wait)
    sweep_tokens_at_most_every()
    answer_for_restarted_nodes()
    try:
        make_database_directory(rest)
    except OSError as err:
        parser.error(f"--database: cannot create its directory: {err}")
    from flwr.superlink.cli import flower_superlink

    sys.argv = ["flower-superlink", *rest]
    flower_superlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
