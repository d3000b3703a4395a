"""``flower-supernode`` with its fixed waits shortened: the SuperNode of a low-latency federation.

    python -m fedfm_flower.deploy.supernode [--poll-interval 0.1] [--max-poll-interval 1]
        <flower-supernode arguments>

Flower's SuperNode (1.41, 1.42) waits in fixed steps that its command line cannot change
(``flwr.supernode.start_client_internal``):

* 3 s after every pull from the SuperLink that found no message, so a message waits 1.5 s on
  average, up to 3 s, before the node sees it;
* 0.5 s between looks for its ClientApp's reply.

Its pulls of a message's objects from the SuperLink, when one is not there yet (the ServerApp
may still be pushing them), wait 1 s, then twice as long each time up to 10 s; here they wait
``--poll-interval``, doubling up to ``--max-poll-interval``.

Its SuperExec then looks for the message's task every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``
seconds (Flower's own setting, default 1 s). On loopback these waits are a third of a round.

This entry point runs Flower's own ``flower-supernode`` with shorter sleeps (``ShortWaits``):
after an empty pull it waits ``--poll-interval`` seconds, 1.5 times longer after each further
empty pull, up to ``--max-poll-interval``; while a message is being handled it looks for the
reply every ``--poll-interval``, and the next idle wait starts short again, because the next
round's message follows a reply closely. An idle node thus pulls about once per
``--max-poll-interval`` (each pull costs the SuperLink a TLS request it authenticates, ~6 ms of
CPU measured here), and a busy one sees its next message within a short wait. It also sets
``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` to ``--poll-interval`` unless the environment sets it
(a local request), and ``FEDFM_SUPEREXEC_MAX_POLL_INTERVAL`` to ``--max-poll-interval``: the
warm SuperExec's task polls back off to it while no task comes and start short again when a
task ends (``fedfm_flower.deploy.superexec``, ``TaskPolls``; at a fixed 0.1 s they were three
quarters of an idle node's CPU). Protocol, messages and results are Flower's.

The change replaces the ``time`` name inside that one Flower module by a view of ``time``
with these sleeps; it is applied only to the Flower versions it was written against. With any
other version the SuperNode runs with Flower's own waits and says so on stderr.

A run stopped (``flwr stop``) while the node pulls one of its messages' objects from the
SuperLink: Flower (1.41, 1.42) then raises ``RunNotRunningException``, a ``BaseException``,
which passes by the ``except Exception`` that would finish the message's task and delete the
message and its objects. The task stays pending with its objects never coming, and the node's
SuperExec waits out its pull patience on it (90 s for the warm executor) before the node takes
the next message, the next run's included. Here that pull raises ``RunStoppedError`` (an
``Exception``) instead (``fail_pulls_of_stopped_runs``), so Flower's own handler runs: the task
ends failed, the message and its objects are deleted, and the SuperExec's pull fails at once. On
the Flower versions above only.

Flower's loop pushes replies only after it pulled a message, and then only those ready at that
moment; it assumes one message in flight. When two are (a stopped run's task still finishing
beside the next run's first message), the second reply, ready a moment after the push, waits for
the node's next message: at 50 SuperNodes a restarted ServerApp's identity query to one node was
answered 2.5 minutes late and that client missed two rounds. Here a pull that finds no message
but a reply the node holds unsent returns that reply's run, so the loop pushes it at once
(``push_stranded_replies``; it reads Flower's in-memory NodeState without marking anything). On
the Flower versions above only.

A SuperLink that fails a request answers ``500`` (Flower hides the cause; under load it is its
SQLite state's ``database is locked``: 16 SuperNodes on 2 cores met it, docs/benchmarks.md).
Flower's SuperNode retries only 502-504 and connection errors, so a 500 to a message pull or a
reply push cost that client its round. Here the node's Fleet requests retry a 500 with Flower's
own backoff (1 s doubling to 20 s, jittered) up to ``SERVER_ERROR_RETRIES`` times in a row
(``retry_server_errors``), then give up as before; on the Flower versions above only. A retried
request is one the SuperLink failed as a whole (its state change rolled back with the error).

A push of a reply's object can fail without a 500: Flower's SuperLink catches the error of its
object store (``database is locked`` again, seen with 50 SuperNodes on 2 cores) and answers
``stored = false``, on which Flower's SuperNode gives up the reply. Here such a push is tried
again after 0.5 s, doubling, up to ``object_pushes.RETRIES`` times (``retry_object_pushes``);
the SuperLink rolled the failed store back, so a retry stores the object once. On the Flower
versions above only.

``--heartbeat-interval S`` (at least Flower's minimum, 10 s) makes the node announce ``S`` as
its heartbeat interval and beat accordingly, instead of Flower's fixed 30 s: the SuperLink then
marks a crashed node offline after 2 x ``S`` of silence (Flower's patience), and a restarted node
(same key) is admitted again that much sooner (``LocalDeployment.restart_supernode`` waits for
it). It replaces that constant in the two Flower modules that read it in the node's process (its
Fleet connection and ``HeartbeatSender``), on the Flower versions above only.

When the node's process exits (``flwr`` stopped it, SIGTERM, Ctrl-C), the processes it started
and theirs (its SuperExec, a ``flwr-clientapp`` per message in flight) get SIGTERM, and SIGKILL
after ``CHILDREN_GRACE_S`` (``stop_children``): a ``flwr-clientapp`` otherwise ran on for 19 s
after its node's exit here (its parent watch and Flower's exit handlers), 90 s in a user's try.

``--warm-executor`` runs the node's ClientApp tasks without a process per message: the SuperNode
starts with ``--isolation process`` and this process keeps ``fedfm_flower.deploy.superexec``
running beside it (started again whenever it exits while the node runs, Flower's
``flower-superexec`` after ``EXECUTOR_FAILURES`` quick failures). On a Flower that SuperExec
does not know, or with TLS on the node's runtime API (``--appio-ssl-*``), the node keeps
Flower's subprocess isolation and says so on stderr. With ``FEDFM_EXECUTOR_FORKSERVER`` naming a
fork server's socket (``DeployOptions.shared_imports``), the warm SuperExec is forked by that
server (``fedfm_flower.deploy.forkserver``), sharing its imports with the other nodes' forks.
The node wakes that SuperExec when it has stored a message and all its objects (``--wake``,
``fedfm_flower.deploy.wake``; ``wake_on_stored_messages``, on the Flower versions above), so
the SuperExec's idle polls of the node's runtime API can be minutes apart instead of
``--max-poll-interval`` without delaying a task, and its task finds the objects there.

Imports inside functions keep ``flwr.supercore``, ``flwr.supernode`` and ``httpx`` out of this
module's start-up; they load ``fedfm_flower.deploy.forkserver`` only when used (runs as a
program, ``python -m``).
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import inspect
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fedfm_flower.deploy import object_pushes, wake
from fedfm_flower.deploy.known_flower import (
    flower_version,
    is_known,
    known_versions,
    wrap_flower_factory,
)
from fedfm_flower.deploy.object_pushes import FIRST_PAUSE_S, FLEET_MODULE, RETRIES
from fedfm_flower.deploy.superexec import MAX_POLL_VAR, unsupported_flower
from fedfm_flower.simulation.processes import descendants, flower_command, stop_processes
from fedfm_flower.simulation.waits import GrowingWait

if TYPE_CHECKING:
    from fedfm_flower.deploy.forkserver import ForkedProcess

LOOP_MODULE = "flwr.supernode.start_client_internal"
PULL_AND_STORE = "_pull_and_store_message"  # the loop's pull: stores a message and its objects
SUPEREXEC_POLL_VAR = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
DEFAULT_POLL_INTERVAL = 0.1
DEFAULT_MAX_POLL_INTERVAL = 1.0
GROWTH = 1.5
REPLY_WAIT_S = 0.5  # Flower's wait between looks for the ClientApp's reply
EXECUTOR_FAILURES = 3  # quick exits of the warm SuperExec before Flower's takes over
QUICK_EXIT_S = 10.0
STOPPED = (0, -signal.SIGTERM, -signal.SIGINT)  # a SuperExec's exits that may be its node's stop
STOPPED_GRACE_S = 5.0  # a stopped SuperExec is started again if its SuperNode outlives this
CHILDREN_GRACE_S = 3.0  # after SIGTERM, a child of an exiting SuperNode gets SIGKILL
EXITING = threading.Event()  # set when the node's process exits: no SuperExec starts again
# The modules of the node's process that read Flower's node heartbeat interval (30 s).
HEARTBEAT_MODULES = ("flwr.supernode.fleet_http_connection", "flwr.supercore.heartbeat")
HEARTBEAT_NAME = "HEARTBEAT_DEFAULT_INTERVAL"
MIN_HEARTBEAT_S = 10.0  # Flower's HEARTBEAT_MIN_INTERVAL: the SuperLink refuses a shorter one
RETRY_FACTORY = "make_simple_http_retry_invoker"
# 500s retried in a row: with Flower's backoff (1, 2, 4, 8, 16, 20 s, jittered), under a minute.
SERVER_ERROR_RETRIES = 6
# Flower's own bounds for FLWR_SUPEREXEC_TASK_POLL_INTERVAL.
MIN_POLL_INTERVAL, MAX_POLL_INTERVAL = 0.01, 60.0


class ShortWaits(GrowingWait):
    """The ``time`` module as the SuperNode loop sees it, with the sleeps of the module doc:
    its empty-pull waits are this ``GrowingWait``. No sleep is longer than Flower asked for."""

    def __init__(self, first: float, longest: float) -> None:
        super().__init__(first, longest, GROWTH)

    @property
    def next_idle(self) -> float:
        """The wait after the next empty pull."""
        return self.upcoming

    def sleep(self, seconds: float) -> None:
        """An empty pull's wait (Flower: 3 s) grows; a reply wait (0.5 s) is short and restarts."""
        if seconds > REPLY_WAIT_S:
            pause = min(next(self), seconds)
        else:
            pause = min(seconds, self.first)
            self.restart()
        time.sleep(pause)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def check_poll_interval(seconds: float) -> float:
    """``seconds`` if it is a usable poll interval, else ValueError naming it."""
    if not (math.isfinite(seconds) and MIN_POLL_INTERVAL <= seconds <= MAX_POLL_INTERVAL):
        raise ValueError(
            f"poll interval must be a number of seconds in [{MIN_POLL_INTERVAL}, "
            f"{MAX_POLL_INTERVAL}], got {seconds!r}"
        )
    return seconds


def check_poll_intervals(first: float, longest: float) -> tuple[float, float]:
    """Both intervals if usable and ``first <= longest``, else ValueError naming the bad one."""
    check_poll_interval(first)
    try:
        check_poll_interval(longest)
    except ValueError as err:
        raise ValueError(f"longest {err}") from None
    if longest < first:
        raise ValueError(f"longest poll interval {longest!r} is below the first, {first!r}")
    return first, longest


def shorten_waits(first: float, longest: float) -> bool:
    """Give the SuperNode loop ``ShortWaits``; False, changing nothing, on another Flower."""
    version = flower_version()
    loop = importlib.import_module(LOOP_MODULE)
    current = getattr(loop, "time", None)
    if not isinstance(current, ShortWaits) and (not is_known(version) or current is not time):
        print(
            f"fedfm_flower.deploy.supernode: Flower {version} is not one whose SuperNode waits "
            f"are known ({known_versions()}); running with its own "
            "waits",
            file=sys.stderr,
        )
        return False
    loop.time = ShortWaits(first, longest)
    pulls = getattr(loop, "pull_objects", None)
    pulls = pulls.func if isinstance(pulls, functools.partial) else pulls
    if pulls is not None and {"initial_backoff", "backoff_cap"} <= set(
        inspect.signature(pulls).parameters
    ):
        loop.pull_objects = functools.partial(pulls, initial_backoff=first, backoff_cap=longest)
    return True


class RunStoppedError(RuntimeError):
    """A message's objects could not be pulled: its run is no longer running."""


def _failing_on_stopped_run(pulls: Any) -> Any:
    """``pulls`` (Flower's ``pull_objects``) raising ``RunStoppedError`` where it raised
    Flower's ``RunNotRunningException``; its signature is that of ``pulls``."""
    from flwr.supercore.run import RunNotRunningException

    @functools.wraps(pulls)
    def pull_objects(*args: Any, **kwargs: Any) -> Any:
        try:
            return pulls(*args, **kwargs)
        except RunNotRunningException:
            raise RunStoppedError("its run is no longer running") from None

    pull_objects.fails_stopped_runs = True  # type: ignore[attr-defined]
    return pull_objects


def fail_pulls_of_stopped_runs() -> bool:
    """Let a message pull that meets a stopped run end its task (module doc); False, changing
    nothing, on a Flower this was not written against or that handles it already."""
    from flwr.supercore.run import RunNotRunningException

    version = flower_version()
    loop = importlib.import_module(LOOP_MODULE)
    pulls = getattr(loop, "pull_objects", None)
    if issubclass(RunNotRunningException, Exception):
        return False  # Flower's own `except Exception` finishes the task
    if pulls is None or not is_known(version):
        print(
            f"fedfm_flower.deploy.supernode: Flower {version}'s message pulls are not ones "
            "this knows; a run stopped during a pull leaves its task to the pull's patience",
            file=sys.stderr,
        )
        return False
    bound = pulls if isinstance(pulls, functools.partial) else None
    inner = bound.func if bound is not None else pulls
    if not getattr(inner, "fails_stopped_runs", False):
        inner = _failing_on_stopped_run(inner)
    loop.pull_objects = (
        functools.partial(inner, *bound.args, **bound.keywords) if bound is not None else inner
    )
    return True


def _retrying_server_errors(make: Any, retries: int) -> Any:
    """``make`` (Flower's retry-invoker factory) whose invokers also retry an HTTP 500, up to
    ``retries`` times in a row (a success starts the count over)."""

    @functools.wraps(make)
    def make_invoker(*args: Any, **kwargs: Any) -> Any:
        import httpx

        invoker = make(*args, **kwargs)
        flowers_giveup, flowers_success = invoker.should_giveup, invoker.on_success
        lock, streak = threading.Lock(), [0]

        def should_giveup(err: Exception) -> bool:
            if isinstance(err, httpx.HTTPStatusError) and err.response.status_code == 500:
                with lock:
                    streak[0] += 1
                    return streak[0] > retries
            return True if flowers_giveup is None else bool(flowers_giveup(err))

        def on_success(state: Any) -> None:
            with lock:
                streak[0] = 0
            if flowers_success is not None:
                flowers_success(state)

        invoker.should_giveup, invoker.on_success = should_giveup, on_success
        return invoker

    make_invoker.retries_server_errors = retries  # type: ignore[attr-defined]
    return make_invoker


def retry_server_errors(retries: int = SERVER_ERROR_RETRIES) -> bool:
    """Let the node's Fleet requests retry a SuperLink's 500 (module doc); False, changing
    nothing, on a Flower whose Fleet connection this was not written against."""
    return wrap_flower_factory(
        FLEET_MODULE,
        RETRY_FACTORY,
        lambda make: _retrying_server_errors(make, retries),
        "fedfm_flower.deploy.supernode",
        "a SuperLink's 500 is not retried",
    )


def retry_object_pushes(retries: int = RETRIES, first_pause: float = FIRST_PAUSE_S) -> bool:
    """Let the node push an object again that the SuperLink did not store (module doc); False,
    changing nothing, on a Flower whose Fleet connection this was not written against."""
    return object_pushes.retry_object_pushes(FLEET_MODULE, retries, first_pause)


def check_heartbeat_interval(seconds: float) -> float:
    """``seconds`` if the SuperLink accepts it as a heartbeat interval, else ValueError."""
    if not (math.isfinite(seconds) and MIN_HEARTBEAT_S <= seconds <= 1800.0):
        raise ValueError(f"heartbeat interval must be in [10, 1800] seconds, got {seconds!r}")
    return seconds


def shorten_heartbeat(seconds: float) -> bool:
    """Announce and keep a node heartbeat of ``seconds`` (module doc); False, changing nothing,
    on a Flower whose modules do not read the constant as written against."""
    check_heartbeat_interval(seconds)
    version = flower_version()
    modules = [importlib.import_module(name) for name in HEARTBEAT_MODULES]
    if not is_known(version) or not all(
        isinstance(getattr(module, HEARTBEAT_NAME, None), (int, float)) for module in modules
    ):
        print(
            f"fedfm_flower.deploy.supernode: Flower {version}'s heartbeat is not one this "
            "knows; the node keeps Flower's heartbeat interval",
            file=sys.stderr,
        )
        return False
    for module in modules:
        setattr(module, HEARTBEAT_NAME, seconds)
    return True


def _option(arguments: Sequence[str], name: str, default: str) -> str:
    """The value of ``name`` in ``arguments`` (``--name value`` or ``--name=value``)."""
    for position, argument in enumerate(arguments):
        if argument == name and position + 1 < len(arguments):
            return arguments[position + 1]
        if argument.startswith(name + "="):
            return argument.split("=", 1)[1]
    return default


def wake_on_stored_messages(send_wake: Callable[[], object]) -> bool:
    """Call ``send_wake`` whenever the node's loop has stored a message and its objects (its
    task can then run at once); False, changing nothing, on a Flower whose loop this was not
    written against."""
    version = flower_version()
    loop = importlib.import_module(LOOP_MODULE)
    pull = getattr(loop, PULL_AND_STORE, None)
    original = getattr(pull, "__wrapped__", pull)
    if not is_known(version) or not callable(original):
        print(
            f"fedfm_flower.deploy.supernode: Flower {version}'s SuperNode loop is not one this "
            f"knows ({known_versions()}); its SuperExec polls for tasks without wake-ups",
            file=sys.stderr,
        )
        return False

    @functools.wraps(original)
    def pull_store_and_wake(*args: Any, **kwargs: Any) -> int | None:
        run_id = original(*args, **kwargs)
        if run_id is not None:
            send_wake()
        return run_id

    setattr(loop, PULL_AND_STORE, pull_store_and_wake)
    return True


def stranded_reply_run(state: Any) -> int | None:
    """The run of a reply the node holds and has not sent (not yet retrieved from its state),
    or None; read without marking it, on Flower's in-memory NodeState (None on another)."""
    store, lock = getattr(state, "msg_store", None), getattr(state, "lock_msg_store", None)
    if not isinstance(store, dict) or lock is None:
        return None
    with lock:
        for entry in store.values():
            message = getattr(entry, "message", None)
            if (
                message is not None
                and not getattr(entry, "is_retrieved", True)
                and message.metadata.reply_to_message_id != ""
            ):
                return int(message.metadata.run_id)
    return None


def push_stranded_replies() -> bool:
    """Let the node's loop push a reply that became ready after its last push (module doc);
    False, changing nothing, on a Flower whose loop this was not written against."""
    version = flower_version()
    loop = importlib.import_module(LOOP_MODULE)
    pull = getattr(loop, PULL_AND_STORE, None)
    if getattr(pull, "pushes_stranded_replies", False):
        return True
    if not is_known(version) or not callable(pull):
        print(
            f"fedfm_flower.deploy.supernode: Flower {version}'s SuperNode loop is not one this "
            f"knows ({known_versions()}); a reply ready after the node's last push waits for "
            "its next message",
            file=sys.stderr,
        )
        return False

    @functools.wraps(pull)
    def pull_or_push_stranded(*args: Any, **kwargs: Any) -> int | None:
        run_id = pull(*args, **kwargs)
        if run_id is None:
            run_id = stranded_reply_run(kwargs.get("state"))
        return run_id

    pull_or_push_stranded.pushes_stranded_replies = True  # type: ignore[attr-defined]
    setattr(loop, PULL_AND_STORE, pull_or_push_stranded)
    return True


def warm_executor_refusal(arguments: Sequence[str]) -> str | None:
    """Why the node must keep Flower's subprocess isolation, or None when it can run the warm
    SuperExec."""

    if any(a.startswith("--isolation") for a in arguments):
        return "the command line sets --isolation itself"
    if any(a.startswith("--appio-ssl") for a in arguments):
        return "the runtime API uses TLS (--appio-ssl-*), which it does not pass on"
    return unsupported_flower()


class ExecutorKeeper:
    """Keeps a SuperExec running for this SuperNode: ours, and Flower's after repeated quick
    failures of ours."""

    def __init__(self, runtime_address: str, wake_name: str | None = None) -> None:
        self.runtime_address = runtime_address
        self.wake_name = wake_name  # the channel ours listens on (fedfm_flower.deploy.wake)
        self.failures = 0
        self.process: subprocess.Popen[bytes] | ForkedProcess | None = None

    def command(self) -> list[str]:
        """Ours while it has not failed ``EXECUTOR_FAILURES`` times in a row, else Flower's."""
        common = ["--insecure", "--runtime-api-address", self.runtime_address]
        common += ["--parent-pid", str(os.getpid())]
        if self.failures < EXECUTOR_FAILURES:
            wake = ["--wake", self.wake_name] if self.wake_name else []
            return [sys.executable, "-m", "fedfm_flower.deploy.superexec", *common, *wake]
        return [flower_command("flower-superexec"), *common]

    def spawn(self) -> subprocess.Popen[bytes] | ForkedProcess:
        """The SuperExec: forked by the fork server that ``FEDFM_EXECUTOR_FORKSERVER`` names
        (ours only), else a process of its own (also when that server cannot be reached)."""
        # Imported here: the package must not load the fork server's module that `python -m`
        # runs.
        from fedfm_flower.deploy.forkserver import FORKSERVER_VAR, request_fork

        command = self.command()
        server = os.environ.get(FORKSERVER_VAR)
        if server and command[:3] == [sys.executable, "-m", "fedfm_flower.deploy.superexec"]:
            try:
                return request_fork(server, command[3:])
            except OSError as err:
                print(
                    f"fedfm_flower.deploy.supernode: no fork from {server} ({err}); starting "
                    "the SuperExec as its own process",
                    file=sys.stderr,
                    flush=True,
                )
        return subprocess.Popen(command)

    def keep(self) -> None:
        """Start the SuperExec, and again whenever it exits while the SuperNode runs (a daemon
        thread of the SuperNode: it ends with the node's process)."""
        while not EXITING.is_set():
            started = time.monotonic()
            self.process = self.spawn()
            code = self.process.wait()
            if EXITING.is_set():
                return
            quick = time.monotonic() - started < QUICK_EXIT_S
            if code in STOPPED:
                # A SuperNode that stops takes its SuperExec (same process group) and this
                # thread with it within the grace; a node still running after it lost its
                # SuperExec to something else (Flower's task heartbeat raised SIGINT in it at
                # 24 SuperNodes) and would otherwise never run a task again.
                time.sleep(STOPPED_GRACE_S)
            self.failures = self.failures + 1 if quick else 0
            print(
                f"fedfm_flower.deploy.supernode: the SuperExec exited ({code}); starting "
                + ("Flower's" if self.failures >= EXECUTOR_FAILURES else "it again"),
                file=sys.stderr,
                flush=True,
            )
            time.sleep(0.5 if quick else 0.0)

    def start(self) -> threading.Thread:
        """Keep the SuperExec running from a daemon thread."""
        thread = threading.Thread(target=self.keep, name="superexec-keeper", daemon=True)
        thread.start()
        return thread


def stop_children(grace: float = CHILDREN_GRACE_S) -> list[int]:
    """SIGTERM every descendant of this process, SIGKILL those alive after ``grace``; returns
    their pids (registered with ``atexit`` by ``main``)."""
    EXITING.set()
    pids = descendants(os.getpid())
    stop_processes(pids, grace, group=False, poll_s=0.05)
    return pids


def with_warm_executor(arguments: list[str]) -> list[str]:
    """``arguments`` with ``--isolation process`` and a kept warm SuperExec, or unchanged (with
    the reason on stderr) when the node must keep Flower's isolation."""
    refusal = warm_executor_refusal(arguments)
    if refusal is not None:
        print(
            f"fedfm_flower.deploy.supernode: no warm executor ({refusal}); the node starts a "
            "flwr-clientapp process per message",
            file=sys.stderr,
            flush=True,
        )
        return arguments
    from flwr.supercore.address import resolve_bind_address
    from flwr.supercore.constant import SUPERNODE_UVICORN_DEFAULT_PORT, UVICORN_DEFAULT_HOST

    host = _option(arguments, "--host", UVICORN_DEFAULT_HOST)
    port = _option(arguments, "--port", str(SUPERNODE_UVICORN_DEFAULT_PORT))
    name: str | None = wake.new_name()
    if not wake_on_stored_messages(functools.partial(wake.send, name)):
        name = None
    ExecutorKeeper(resolve_bind_address(f"{host}:{port}"), name).start()
    return [*arguments, "--isolation", "process"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the two intervals, shorten the waits, let stopped runs' pulls fail, then run
    ``flower-supernode`` on the rest."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.deploy.supernode",
        description=__doc__.splitlines()[0],
        epilog="Every other argument goes to flower-supernode unchanged.",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_INTERVAL,
        help=f"shortest wait in seconds (default {DEFAULT_POLL_INTERVAL})",
    )
    parser.add_argument(
        "--max-poll-interval",
        type=float,
        default=DEFAULT_MAX_POLL_INTERVAL,
        help=f"longest idle wait in seconds (default {DEFAULT_MAX_POLL_INTERVAL})",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=None,
        help="node heartbeat interval in seconds, >= 10 (default: Flower's 30)",
    )
    parser.add_argument(
        "--warm-executor",
        action="store_true",
        help="run the ClientApp tasks in one kept process (fedfm_flower.deploy.superexec)",
    )
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    try:
        first, longest = check_poll_intervals(args.poll_interval, args.max_poll_interval)
    except ValueError as err:
        parser.error(f"--poll-interval/--max-poll-interval: {err}")
    if args.heartbeat_interval is not None:
        try:
            check_heartbeat_interval(args.heartbeat_interval)
        except ValueError as err:
            parser.error(f"--heartbeat-interval: {err}")
    os.environ.setdefault(SUPEREXEC_POLL_VAR, repr(first))  # inherited by its SuperExec
    os.environ.setdefault(MAX_POLL_VAR, repr(longest))  # read by the warm SuperExec only
    shorten_waits(first, longest)
    fail_pulls_of_stopped_runs()
    retry_server_errors()
    retry_object_pushes()
    if args.heartbeat_interval is not None:
        shorten_heartbeat(args.heartbeat_interval)
    if args.warm_executor:
        rest = with_warm_executor(rest)
    push_stranded_replies()  # over the wake-ups' wrapper of the same pull
    atexit.register(stop_children)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
