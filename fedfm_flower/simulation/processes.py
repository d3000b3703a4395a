"""Flower's processes as this project starts and stops them: their environment and signals.

Both launchers (``fedfm_flower.simulation.launcher`` and ``fedfm_flower.deploy``) use these, so
where Flower's commands are found, the recommended environment and the way a vanished process is
tolerated are defined once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path


class FlowerCommandNotFound(FileNotFoundError):
    """One of Flower's commands is neither beside this interpreter nor on PATH (a one-line message
    for the user: where it was looked for and how to fix it)."""


def flower_command(name: str) -> str:
    """Path of Flower's command ``name`` (``flwr``, ``flower-superlink``, ...): beside this
    interpreter (``sys.executable``'s directory), else the first on PATH.

    Raises ``FlowerCommandNotFound`` naming both places when neither has it, e.g. when Flower
    was installed with ``pip install --target DIR`` (its commands land in ``DIR/bin``).
    """
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is not None:
        return found
    raise FlowerCommandNotFound(
        f"Flower's `{name}` command not found: looked for {beside} (beside {sys.executable}) "
        f"and on PATH ({os.environ.get('PATH', '')}); install Flower into this interpreter "
        f"(`{sys.executable} -m pip install -e <this repository>`) or put the directory that "
        f"holds `{name}` on PATH (after `pip install --target DIR`: DIR/bin)"
    )


def flower_environment(flwr_home: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for Flower's CLI and daemons: our FLWR_HOME, no runtime installs, HF offline,
    no usage reports, a Ray of its own unless ``RAY_ADDRESS`` names one.

    ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION`` stops ``flwr run``/SuperLink/SuperNodes from
    running ``uv sync`` (which would download torch again); this interpreter's scripts come first
    on PATH because Flower spawns ``flower-superlink`` and ``flwr-clientapp`` by name. Flower's
    telemetry and Ray's usage stats are off unless the caller's environment turns them on
    (``FLWR_TELEMETRY_ENABLED=1``, ``RAY_USAGE_STATS_ENABLED=1``): every Flower process of a run
    otherwise posts events to telemetry.flower.ai (an HTTPS request with a fresh TLS context,
    0.5 s of CPU in the simulation process at start-up), and the runs are offline by design.
    """
    env = dict(os.environ if base is None else base)
    env["FLWR_HOME"] = str(flwr_home)
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's raylet starts idle workers for tasks (one per CPU, and again when the driver joins);
    # a simulation runs only actors, each in a worker of its own, so they would import Ray's
    # worker code and sit idle: 3 of the main job's 5 workers on 2 cores.
    env.setdefault("RAY_enable_worker_prestart", "0")
    env.setdefault("RAY_prestart_worker_first_driver", "0")
    # Without an address, ray.init joins the cluster named in /tmp/ray/ray_current_cluster (one
    # that `ray start` left, e.g. for a sweep) instead of starting the simulation's own.
    env.setdefault("RAY_ADDRESS", "local")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit(143)`` in the main thread, so ``finally`` clean-ups run.

    Python's default for SIGTERM ends the process at once. A launcher stopped that way by
    ``timeout``, a batch scheduler or ``kill`` would leave the detached SuperLink and Ray
    running; a later ``flwr run`` would then quietly use that old SuperLink.
    """

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def signal_process(pid: int, sig: int, group: bool = True) -> None:
    """Send ``sig`` to the group ``pid`` leads (when ``group``) or to ``pid``; vanished is fine.

    Only groups led by ``pid`` are signalled (our launchers start processes in new sessions), so
    the caller's own group is never hit; a ``pid`` that leads no group gets the signal alone.
    """
    if group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
            return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...); [] if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return []


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 when it is gone)."""
    fields = proc_stat(pid)
    if not fields:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime in clock ticks


def proc_cmdline(pid: int) -> list[str]:
    """The command line of ``pid``, argument by argument; [] if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            raw = handle.read()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1] if raw else []


def pid_alive(pid: int) -> bool:
    """True for a running (not zombie) process."""
    fields = proc_stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def pids_with_environment(variables: Mapping[str, str], command: str | None = None) -> set[int]:
    """Live processes whose environment holds every ``variables`` entry (this one excluded).

    Launchers tag the processes they start with an environment variable; children inherit it,
    even those Flower and Ray start in new sessions, so the tag finds them all. ``command``:
    only processes whose command line contains it.
    """
    markers = {f"{key}={value}".encode() for key, value in variables.items()}
    found = set()
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                if not markers <= set(handle.read().split(b"\0")):
                    continue
        except OSError:
            continue
        if command is not None and command not in "\0".join(proc_cmdline(int(entry.name))):
            continue
        found.add(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (children first), from /proc's parent ids."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = proc_stat(int(entry.name))
            if len(fields) > 1 and fields[0] not in ("Z", "X"):
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        below = [child for parent in frontier for child in children.get(parent, [])]
        found += below
        frontier = below
    return found


def stop_processes(
    pids: list[int], grace_s: float = 10.0, *, group: bool = True, poll_s: float = 0.2
) -> None:
    """SIGTERM ``pids`` (their process groups unless ``group`` is false), then SIGKILL what is
    still alive after ``grace_s``."""
    for pid in pids:
        signal_process(pid, signal.SIGTERM, group=group)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(poll_s)
    for pid in pids:
        if pid_alive(pid):
            signal_process(pid, signal.SIGKILL, group=group)


def stop_tagged(variables: Mapping[str, str], grace_s: float = 10.0) -> None:
    """Stop every process whose environment holds ``variables`` (``stop_processes``), then
    SIGKILL any that appeared meanwhile (a parent may spawn while it is being stopped)."""
    stop_processes(sorted(pids_with_environment(variables)), grace_s)
    for pid in pids_with_environment(variables):
        signal_process(pid, signal.SIGKILL, group=False)
