"""The processes of one deployment: started in their own sessions, logged, found and reaped.

Every process started here runs in its own session (so Ctrl-C reaches only the launcher) with
its output copied, time-stamped, to a log. Flower starts SuperExec, ServerApp and ClientApp
processes in new sessions of their own, so each process of a deployment carries the
deployment's tag in its environment (``FEDFM_DEPLOY_ID``, and ``FEDFM_DEPLOY_NODE`` for the
processes of one SuperNode): that is how they are found and stopped. The launcher becomes a
child subreaper where Linux allows it, so orphaned descendants are adopted and reaped.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

from fedfm_flower.simulation.processes import pids_with_environment

TAG_VAR = "FEDFM_DEPLOY_ID"  # environment variable marking every process of one deployment
NODE_VAR = "FEDFM_DEPLOY_NODE"  # ... and the processes of one SuperNode (its index)

_subreaper = False  # become_subreaper() succeeded: orphaned descendants are ours to reap


def tagged_pids(tag: str, node: int | None = None, command: str | None = None) -> set[int]:
    """Pids of live processes whose environment carries ``FEDFM_DEPLOY_ID=<tag>``.

    ``node``: only processes of SuperNode ``node`` (``FEDFM_DEPLOY_NODE``, inherited by the
    SuperNode's ClientApp processes); ``command``: only those whose command line contains it.
    """
    variables = {TAG_VAR: tag} if node is None else {TAG_VAR: tag, NODE_VAR: str(node)}
    return pids_with_environment(variables, command)


def _reap_orphans() -> None:
    """Reap exited children adopted as a child subreaper (none otherwise)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux prctl PR_SET_CHILD_SUBREAPER), so none escapes."""
    global _subreaper
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _subreaper = libc.prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        _subreaper = False
    return _subreaper


def reap_orphans_if_safe(processes: Sequence[ManagedProcess]) -> None:
    """Reap adopted orphans, unless a started process is still running: waitpid(-1) must not
    steal the exit status of a Popen still being tracked."""
    if _subreaper and all(p.popen.returncode is not None for p in processes):
        _reap_orphans()


@contextlib.contextmanager
def shield_signals() -> Iterator[None]:
    """Ignore Ctrl-C/SIGTERM while cleaning up (only possible in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):
            previous[sig] = signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ManagedProcess:
    """A process started in its own session, its output copied with time stamps to a log."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        log_path: Path,
        env: Mapping[str, str],
        cwd: Path,
        t0: float,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self.command = list(command)
        self.log_path = log_path
        self.started = time.monotonic()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[str] = log_path.open("a", encoding="utf-8", errors="replace")
        self._log.write(f"# {stamp(t0)} $ {shlex.join(self.command)}\n")
        self._log.flush()
        self.popen = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=str(cwd),
            start_new_session=True,  # own process group: Ctrl-C reaches only this script
        )
        self.lines: list[str] = []
        self._thread = threading.Thread(
            target=self._copy, args=(t0, echo), name=f"log-{name}", daemon=True
        )
        self._thread.start()

    @property
    def pid(self) -> int:
        """Process id (also its process group id)."""
        return self.popen.pid

    def _copy(self, t0: float, echo: Callable[[str], None] | None) -> None:
        assert self.popen.stdout is not None
        for raw in iter(self.popen.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            self._log.write(f"{stamp(t0)} {line}\n")
            self._log.flush()
            if echo is not None:
                echo(line)
        self._log.write(f"# {stamp(t0)} exited with {self.popen.wait()}\n")
        self._log.close()

    def alive(self) -> bool:
        """Still running."""
        return self.popen.poll() is None

    def tail(self, lines: int = 15) -> str:
        """The last lines of its output."""
        return "\n".join(self.lines[-lines:])

    def join_output(self, timeout: float = 5.0) -> None:
        """Wait until the output copy has reached EOF."""
        self._thread.join(timeout)


def stamp(t0: float) -> str:
    """Wall-clock time and seconds since ``t0``, for log lines."""
    now = _dt.datetime.now().strftime("%H:%M:%S.%f")[:-3]
    return f"{now} +{time.monotonic() - t0:8.3f}s"
