"""A SuperExec that runs its SuperNode's ClientApp tasks in one long-lived process.

    python -m fedfm_flower.deploy.superexec --runtime-api-address HOST:PORT --insecure
        [--parent-pid PID]

Flower's SuperNode (1.41, 1.42) hands each message to its SuperExec as a task with a one-use
token; the SuperExec's executor starts a ``flwr-clientapp`` process for it, which pays Python's
start, Flower's imports and the FAB's installation on every message (about half of a deployed
round on loopback, ``docs/benchmarks.md``). This command is Flower's own SuperExec loop
(``run_superexec``: task acquisition, tracing, signals, the parent-pid watch) with one change,
made through the loop's executor factory: ``WarmExecutor`` runs every ClientApp task in a thread
of this process, doing what ``flwr-clientapp`` does with the token (heartbeats, pull the task
input, run the ClientApp, push the reply and the final context) with Flower's own functions, and
keeps the ClientApp and everything it loaded (torch, the model, the data) from one task to the
next. Other task types go to Flower's executor.

* **One task at a time.** While a ClientApp task runs, the executor offers no capacity for
  another (Flower's SuperNode sends one message at a time anyway).
* **A new FAB.** The ClientApp is loaded from the installed FAB's directory, like Flower's; when a
  task brings another FAB, the modules loaded from the old one are dropped first, so no code of
  an old FAB serves a new run.
* **Errors.** An exception in the ClientApp becomes Flower's error reply, in Flower's words, and
  the task ends failed; the process serves the next task. A crash of the process (SIGKILL, out of
  memory) loses the task in flight as a crashed ``flwr-clientapp`` would (the SuperNode replies
  ``CLIENT_APP_CRASHED`` once its heartbeats stop); ``fedfm_flower.deploy.supernode``, which
  starts this command, starts it again.
* **Guarded.** It runs only on the Flower it was written against (``known_flower`` and the
  functions and fields it uses, ``unsupported_flower``); on any other it says why on stderr and
  runs Flower's ``flower-superexec`` with the same arguments (but ``--wake``).
  ``--allow-runtime-dependency-installation`` tasks also go to Flower's executor.
* **Prompt pulls.** A task can reach this process before its SuperNode holds every object of the
  message; Flower's object pull then waits 1 s, then 2 s, ... (its ``PULL_INITIAL_BACKOFF``,
  sized for a ``flwr-clientapp`` that starts a second later). ``pull_task_input`` here is
  Flower's, with the pauses from ``PULL_FIRST_PAUSE_S`` doubling up to ``PULL_LONGEST_PAUSE_S``,
  and every ``--max-poll-interval`` once ``SLOW_PULL_S`` passed without an arrival
  (measured on loopback: 1.2-3.3 s of a 1.3-3.9 s training task was that wait; what is left is
  the SuperNode's own download of the objects from the SuperLink, about 1 s on the busy 2-core
  machine). The pull gives up once no object of the message has arrived for
  ``PULL_PATIENCE_S`` (90 s; ``PatientPull``), not after Flower's 500 tries per object, which
  with these short pauses ran out in ~40 s under load (16 SuperNodes on 2 cores); a task whose
  objects never come gives up then (a run stopped mid-transfer ends its task at once where the
  node runs through ``fedfm_flower.deploy.supernode``). Flower's SuperNode stores a
  message's objects only once it has fetched them all, so in practice the first arrival waits
  for the whole download, which took 94-213 s with 24 SuperNodes on 2 cores:
  ``FEDFM_PULL_PATIENCE_S`` raises the patience for such loads. A task that gave up on its
  message's content still answers it with Flower's error reply (``message_shell``): Flower's
  ``flwr-clientapp`` replies only to a message it pulled whole, and Flower's SuperNode makes an
  error reply only when a task's heartbeat stops, so an unanswered node waited for that reply for
  the rest of the run (34 of 50 SuperNodes at the 90 s patience, 2026-11-28).
* **A refused task ends alone.** Flower's retry of a runtime request sends SIGINT to the
  process when the SuperNode answers 401 (the task's token is no longer valid: the SuperNode
  ended the task, e.g. its run was stopped while its message arrived) and raises
  ``RunNotRunningException``, a ``BaseException``, on 403 (its run stopped); in
  ``flwr-clientapp`` either ends one task, here it would end the process and the node's later
  tasks until it is started again. A task's requests here give up on both (``task_retry``):
  the request's error ends the task as a failed one and the process serves the next.
* **Task polls that back off.** Flower's loop asks its SuperNode for a task every
  ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds (0.1 s where ``fedfm_flower.deploy.supernode``
  starts it), busy or idle: a local HTTP request the SuperNode's runtime API serves. Idle, that
  was three quarters of a SuperNode's CPU and most of its SuperExec's (measured on loopback:
  per 20 s, 50 and 31 ticks at 0.1 s against 12 and 3.5 at 1 s). Here the pause after a poll
  that found no task grows 1.5 times up to ``FEDFM_SUPEREXEC_MAX_POLL_INTERVAL`` (the node's
  ``--max-poll-interval``; without it, Flower's interval: no change), and the end of a task
  starts it over at once (``TaskPolls``): a reply is followed closely by the next message.
  With ``--wake NAME`` (``fedfm_flower.deploy.supernode`` passes it) the SuperNode also wakes
  the poll when it has stored a message with all its objects (``fedfm_flower.deploy.wake``),
  and the loop polls only then, when a task ends, and every ``WOKEN_LONGEST_POLL_S`` (5 min, in
  case a wake was lost): an idle node's runtime API serves no polls instead of one every
  ``--max-poll-interval``, and the task, taken on the wake, finds its message's objects at
  once instead of looking for them while the node downloads them (53 s on average at 50
  nodes; with short polls after a task's end, or a poll every 30 s, tasks at 30 nodes were
  still taken mid-download and asked for their objects for a median 11 s). Flower's parent
  watch is a thread of its own (every 0.2 s), so the long pause does not delay the exit when
  the SuperNode dies.
* **Tracking.** With ``FEDFM_TASKS_DIR`` set, a task in progress is a file
  ``<task id>.running`` there (``fedfm_flower.deploy.local`` uses it to see messages in flight).

Imports inside functions keep ``flwr.app``, ``flwr.cli``, ``flwr.clientapp``, ``flwr.common``,
``flwr.proto``, ``flwr.supercore``, ``flwr.supernode`` and ``httpx`` out of this module's
start-up.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from fedfm_flower.deploy import wake
from fedfm_flower.deploy.known_flower import flower_version, is_known, known_versions
from fedfm_flower.simulation.processes import flower_command
from fedfm_flower.simulation.waits import GrowingWait

REFUSED = (401, 403)  # a task's token or run no longer valid: the task ends, not the process
TASKS_DIR_VAR = "FEDFM_TASKS_DIR"  # where the running tasks are marked (LocalDeployment sets it)
# Between looks for a message's objects at the SuperNode (a local request its runtime API
# serves): they come from the SuperLink in about a second on an idle machine, in 5-60 s with
# many nodes on 2 cores. Capped at 0.05 s such looks were most of a loaded SuperNode's CPU
# (py-spy, 4 nodes beside other work); at 0.25 s an arrival is seen at most that late.
PULL_FIRST_PAUSE_S, PULL_LONGEST_PAUSE_S = 0.01, 0.25
# A pull that has waited this long without an arrival looks every --max-poll-interval instead
# (1 s by default): with 50 SuperNodes on 2 cores a task waited 111 s for its message (its app
# ran 3 s), ~440 looks at 0.25 s, and serving them gave the SuperNodes 2.4x the executors' CPU,
# which the SuperLink, slowed, then lacked for the downloads (a loop). Short pulls keep 0.25 s.
SLOW_PULL_S = 5.0
SLOW_PULL_PAUSE_S = 1.0  # without FEDFM_SUPEREXEC_MAX_POLL_INTERVAL
# How long a task waits for the next of its message's objects. Long enough for a loaded
# SuperNode; short enough that a task whose objects never come (a SuperNode without
# fedfm_flower.deploy.supernode's stopped-run mend, a lost transfer) frees the executor for the
# next run's messages well within the ServerApp's 120 s identity query.
PULL_PATIENCE_S = 90.0
# Overrides it, in seconds (DeployOptions.pull_patience sets it for every node): a SuperNode
# stores a message's objects only once it has fetched them all, which took 94 s with 24
# SuperNodes on 2 cores.
PULL_PATIENCE_VAR = "FEDFM_PULL_PATIENCE_S"
# The longest pause between task polls (the node's --max-poll-interval; unset: no growth).
MAX_POLL_VAR = "FEDFM_SUPEREXEC_MAX_POLL_INTERVAL"
TASK_POLL_GROWTH = 1.5
# The pause between a woken SuperExec's polls when nothing wakes it: a safety net only (a wake
# is lost only if the process is not listening, and a starting one polls first). Longer than a
# round: at 30 s it fell inside the next message's download at 30 nodes (42 s rounds), and the
# task taken then asked for its objects until they came (median 11 s).
WOKEN_LONGEST_POLL_S = 300.0
SPEC_FIELDS = ("task_type", "runtime_api_address", "token", "insecure", "task_id")
RUNTIME_FUNCTIONS = ("push_message", "push_task_output")

log = logging.getLogger("fedfm_flower.superexec")


def unsupported_flower() -> str | None:
    """Why this SuperExec cannot run on the installed Flower, or None when it can."""
    version = flower_version()
    if not is_known(version):
        return f"Flower {version} is not one it knows ({known_versions()})"
    try:
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec import run_superexec
        from flwr.supercore.superexec.executor.types import ExecutionSpec
        from flwr.supernode.runtime import run_clientapp
    except ImportError as err:
        return f"Flower {version} lacks a module it uses ({err})"
    missing = [name for name in RUNTIME_FUNCTIONS if not hasattr(run_clientapp, name)]
    try:
        from flwr.supercore.inflatable import inflatable_utils

        parameters = inspect.signature(inflatable_utils.pull_and_inflate_object_from_tree)
    except (ImportError, AttributeError) as err:
        missing.append(f"pull_and_inflate_object_from_tree ({err})")
    else:
        missing += [
            f"pull_and_inflate_object_from_tree({name}=)"
            for name in ("initial_backoff", "backoff_cap")
            if name not in parameters.parameters
        ]
    loop_names = ("run_superexec", "get_executor")
    missing += [name for name in loop_names if not hasattr(run_superexec, name)]
    spec_fields = {field.name for field in fields(ExecutionSpec)}
    missing += [f"ExecutionSpec.{name}" for name in SPEC_FIELDS if name not in spec_fields]
    if getattr(TaskType, "CLIENT_APP", None) != "flwr-clientapp":
        missing.append("TaskType.CLIENT_APP")
    return f"Flower {version} lacks {', '.join(missing)}" if missing else None


class AppCache:
    """The ClientApp of the last FAB a task brought, installed and loaded once."""

    def __init__(self) -> None:
        self.fab_hash: str | None = None
        self.app_dir: Path | None = None
        self.app: Any = None

    def load(self, run: Any, fab: Any) -> Any:
        """The ClientApp of ``fab`` (installing it and dropping an older FAB's modules first)."""
        if fab.hash_str == self.fab_hash and self.app is not None:
            return self.app
        from flwr.cli.install import install_from_fab
        from flwr.clientapp.utils import get_load_client_app_fn
        from flwr.common.config import get_project_dir

        if self.app_dir is not None:
            self.forget(self.app_dir)
        install_from_fab(fab.content, skip_prompt=True)
        self.app_dir = Path(get_project_dir(run.fab_id, run.fab_version, fab.hash_str))
        load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
        self.app = load(run.fab_id, run.fab_version, fab.hash_str)
        self.fab_hash = fab.hash_str
        return self.app

    @staticmethod
    def forget(app_dir: Path) -> None:
        """Drop every module loaded from ``app_dir`` and the directory from ``sys.path``."""
        root = str(app_dir.resolve())
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if path and os.path.realpath(path).startswith(root + os.sep):
                del sys.modules[name]
        sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or ".") != root]


def pull_task_input(
    client: Any, announced: Callable[[Any, Any], None] | None = None
) -> tuple[Any, Any, Any, Any]:
    """Flower's ``pull_task_input`` (the task's context, run and FAB, then its message), with
    short pauses while the message's objects are not yet at the SuperNode; ``announced`` gets
    the message without its content (``message_shell``) and the context before they are
    pulled."""
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
        PullAppMessagesRequest,
        PullTaskInputRequest,
    )
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.task_identity import TaskIdentity

    response = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = response.task_id
    TaskIdentity.run_id = response.run.run_id
    TaskIdentity.node_id = response.context.node_id
    context = context_from_proto(response.context)
    run, fab = run_from_proto(response.run), fab_from_proto(response.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    if announced is not None:
        announced(message_shell(pulled.messages_list[0], tree.object_id), context)
    message = pull_message(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(
            client.ConfirmMessageReceived, node, context.run_id
        ),
    )
    return message, context, run, fab


def message_shell(proto: Any, message_id: str) -> Any:
    """The message of ``proto`` (as the runtime API lists it: metadata, no content) with its
    id: what an error reply needs when its content could not be pulled."""
    from flwr.common.serde import message_from_proto

    shell = message_from_proto(proto)
    shell.metadata.__dict__["_message_id"] = message_id
    return shell


def pull_message(tree: Any, pull_object: Any, confirm_received: Any) -> Any:
    """The message of ``tree``, its objects pulled with short pauses while they are not yet at
    the SuperNode, for as long as one arrives at least every ``PULL_PATIENCE_S``."""
    from flwr.app import Message
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree

    message = pull_and_inflate_object_from_tree(
        tree,
        PatientPull(pull_object, pull_patience(), slow_pause=slow_pull_pause()),
        confirm_received,
        return_type=Message,
        initial_backoff=PULL_FIRST_PAUSE_S,
        backoff_cap=PULL_LONGEST_PAUSE_S,
        # Flower bounds a pull by tries (500) and time (2 h); its tries last minutes with its
        # 1-10 s pauses, but ~25 s with these short ones, and a loaded SuperNode takes longer
        # than that, or than any fixed time, to fetch a large message: PatientPull bounds it.
        max_tries_per_object=None,
        max_time=None,
    )
    message.metadata.__dict__["_message_id"] = tree.object_id  # the deflated message lacks it
    return message


def pull_patience(environ: Mapping[str, str] = os.environ) -> float:
    """``PULL_PATIENCE_S``, or the positive number of seconds ``FEDFM_PULL_PATIENCE_S`` says
    (ValueError naming it otherwise)."""
    raw = environ.get(PULL_PATIENCE_VAR)
    if raw is None:
        return PULL_PATIENCE_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{PULL_PATIENCE_VAR}={raw!r}: must be a positive number of seconds")
    return seconds


def slow_pull_pause(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds between a slow pull's looks: the node's ``--max-poll-interval``
    (``FEDFM_SUPEREXEC_MAX_POLL_INTERVAL``), else ``SLOW_PULL_PAUSE_S``; never below
    ``PULL_LONGEST_PAUSE_S``."""
    return max(longest_task_poll(environ) or SLOW_PULL_PAUSE_S, PULL_LONGEST_PAUSE_S)


class PatientPull:
    """A pull of one object (Flower's ``pull_object_fn``) that gives up, failing the whole
    message's pull, once no object of the message has arrived for ``patience`` seconds (since
    the first try or the last arrival): a slow transfer goes on, a dead one ends. Once none has
    arrived for ``SLOW_PULL_S``, each look that finds nothing first waits so that looks come
    every ``slow_pause`` seconds, not every ``PULL_LONGEST_PAUSE_S`` (Flower's pause follows)."""

    def __init__(
        self, pull_object: Any, patience: float, slow_pause: float = PULL_LONGEST_PAUSE_S
    ) -> None:
        self.pull_object = pull_object
        self.patience = patience
        self.slow_pause = slow_pause
        self.last_arrival = time.monotonic()

    def __call__(self, object_id: str) -> bytes:
        """The object's bytes; Flower's ObjectUnavailableError to try again, ObjectPullError
        past the patience."""
        from flwr.supercore.inflatable.inflatable_utils import (
            ObjectPullError,
            ObjectUnavailableError,
        )

        try:
            content = self.pull_object(object_id)
        except ObjectUnavailableError:
            waited = time.monotonic() - self.last_arrival
            if waited > self.patience:
                raise ObjectPullError(
                    object_id, f"no object of the message arrived in {waited:.0f} s"
                ) from None
            if waited > SLOW_PULL_S and self.slow_pause > PULL_LONGEST_PAUSE_S:
                time.sleep(self.slow_pause - PULL_LONGEST_PAUSE_S)
            raise
        self.last_arrival = time.monotonic()
        return content


def task_retry() -> Any:
    """Flower's retry for runtime requests, giving up with the request's error on 401 and 403
    where Flower's sends SIGINT or raises ``RunNotRunningException`` (module doc)."""
    import httpx
    from flwr.supercore.retry import make_simple_http_retry_invoker

    retry = make_simple_http_retry_invoker()
    flower_giveup = retry.should_giveup

    def should_giveup(err: Exception) -> bool:
        if isinstance(err, httpx.HTTPStatusError) and err.response.status_code in REFUSED:
            return True
        return bool(flower_giveup(err))

    retry.should_giveup = should_giveup
    return retry


def run_task(spec: Any, apps: AppCache) -> None:
    """What ``flwr-clientapp`` does with one token, in this process: heartbeats, the task input,
    the ClientApp, the reply and the final context (Flower's functions and error replies)."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.clientapp.client_app import LoadClientAppError
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.runtime.tracing import RuntimeTracingInterceptor
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

    started = time.perf_counter()
    phases: dict[str, float] = {}
    retry = task_retry()
    client = RuntimeHttpClient.from_server_address(
        server_address=spec.runtime_api_address,
        insecure=spec.insecure,
        root_certificates=validate_and_resolve_root_certificates(
            spec.root_certificates_path, spec.insecure
        ),
        interceptors=[
            RuntimeTracingInterceptor(),
            RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
            RuntimeTokenHttpInterceptor(spec.token),
        ],
        retry_invoker=retry,
    )
    heartbeat = None
    message = reply = context = shell = None
    sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    marker = None
    try:
        marker = _marker(spec.task_id)
        heartbeat = HeartbeatSender(task_heartbeat(client, spec.task_id))
        heartbeat.start()

        def announced(pulled_shell: Any, pulled_context: Any) -> None:
            nonlocal shell, context
            shell, context = pulled_shell, pulled_context

        message, context, run, fab = pull_task_input(client, announced)
        phases["pull"] = time.perf_counter() - started
        client_app = apps.load(run, fab)
        reply = client_app(message=message, context=context)
        phases["app"] = time.perf_counter() - started - phases["pull"]
        sub_status, details = SubStatus.COMPLETED, ""
    except Exception as ex:  # noqa: BLE001 - Flower's reply to any exception of the ClientApp
        code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        reason = str(type(ex)) + ":<'" + str(ex) + "'>"  # Flower's words, as flwr-clientapp
        if isinstance(ex, LoadClientAppError):
            code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
            reason = "An exception was raised when attempting to load `ClientApp`"
        log.error("ClientApp raised an exception", exc_info=ex)
        details = reason
        if message is not None or shell is not None:
            # A message whose content never arrived is answered too: unanswered, its SuperNode
            # waits for the reply for the rest of the run (Flower stores error replies only for
            # tasks whose heartbeat stopped), and its round for its timeout.
            replied = message if message is not None else shell
            reply = Message(Error(code=code, reason=reason), reply_to=replied)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        except Exception as ex:  # noqa: BLE001 - the node may be gone; the task still ends
            log.error("failed to push the reply", exc_info=ex)
        retry.max_tries = 1
        try:
            push_task_output(client=client, context=context, sub_status=sub_status, details=details)
        except Exception as ex:  # noqa: BLE001 - a refused token: the task still ends here
            log.error("failed to push the task's output", exc_info=ex)
        if heartbeat is not None and heartbeat.is_running:
            heartbeat.stop()
        client.close()
        if marker is not None:
            marker.unlink(missing_ok=True)
    kind = message.metadata.message_type if message is not None else "?"
    total = time.perf_counter() - started
    parts = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in phases.items())
    print(
        f"warm executor: task {spec.task_id} ({kind}) {sub_status} in {total:.3f} s ({parts})",
        file=sys.stderr,
        flush=True,
    )


def task_heartbeat(client: Any, task_id: int) -> Any:
    """Flower's task heartbeat (``make_task_heartbeat_fn_http``) without its SIGINT: Flower's
    raises SIGINT in the process when the SuperNode refuses a heartbeat (the task's token
    expired, its run ended), which ends a ``flwr-clientapp`` but here would end the SuperExec
    and every later task of the node (seen with 24 SuperNodes on 2 cores: a heartbeat starved
    past the token's 60 s). A refusal is logged once and ends nothing: the task's own requests
    then fail, it ends as a failed task and the process serves the next. Transport errors and
    503/504 are retried, as Flower's."""
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest  # pylint: disable=E0611

    refused = threading.Event()

    def beat() -> bool:
        if refused.is_set():
            return True
        try:
            response = client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except httpx.TransportError:
            return False
        except httpx.HTTPStatusError as err:
            if err.response.status_code in (503, 504):
                return False
            reason = f"HTTP {err.response.status_code}"
        else:
            if response.success:
                return True
            reason = "not acknowledged"
        refused.set()
        log.warning("task %s: its heartbeat was refused (%s); the task goes on", task_id, reason)
        return True

    return beat


def _marker(task_id: int) -> Path | None:
    directory = os.environ.get(TASKS_DIR_VAR)
    if not directory:
        return None
    path = Path(directory) / f"{task_id}.running"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(os.getpid()))
    return path


class TaskPolls(GrowingWait):
    """The ``time`` module as Flower's SuperExec loop sees it: its one fixed sleep, between task
    polls, grows from Flower's interval to ``longest`` (never below Flower's) while no task
    comes; ``poll_now`` cuts the current pause short and starts the pauses over. ``woken``
    (the SuperNode wakes this process when a task is there): every pause is ``cap``, cut short by
    ``poll_now``."""

    def __init__(self, longest: float) -> None:
        super().__init__(longest, longest, TASK_POLL_GROWTH)
        self.cap = longest
        self.woken = False
        self.ended = threading.Event()
        self.ended.set()  # the first pause is Flower's interval

    def sleep(self, seconds: float) -> None:
        """Flower's ``time.sleep(task_poll_interval)``: ``seconds`` the first time and after a
        task ended, then longer up to ``longest``; ``poll_now`` wakes it."""
        self.first, self.longest = seconds, max(self.cap, seconds)
        if self.woken:
            if self.ended.wait(self.longest):
                self.ended.clear()
            return
        if self.ended.is_set():
            self.ended.clear()
            self.restart()
        if self.ended.wait(max(next(self), seconds)):
            self.ended.clear()
            self.restart()

    def poll_now(self) -> None:
        """A task ended or a message arrived: poll now, then again after short pauses."""
        self.ended.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def longest_task_poll(environ: Mapping[str, str] = os.environ) -> float | None:
    """``FEDFM_SUPEREXEC_MAX_POLL_INTERVAL`` in seconds, None when unset; ValueError naming it
    when it is not a usable interval."""
    raw = environ.get(MAX_POLL_VAR)
    if raw is None or raw == "":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{MAX_POLL_VAR}={raw!r} is not a number of seconds") from None
    if not (0.01 <= seconds <= 60.0):  # Flower's own bounds for its poll interval
        raise ValueError(f"{MAX_POLL_VAR}={raw!r} must lie in [0.01, 60] seconds")
    return seconds


class WarmExecutor:
    """Flower's ``Executor`` protocol: ClientApp tasks in a thread of this process, the rest in
    ``fallback`` (Flower's own executor). ``polls``, when given, hears of each task's end."""

    def __init__(self, fallback: Any, polls: TaskPolls | None = None) -> None:
        from flwr.supercore.constant import TaskType

        self.fallback = fallback
        self.polls = polls
        self.client_app = TaskType.CLIENT_APP
        self.apps = AppCache()
        self.thread: threading.Thread | None = None
        directory = os.environ.get(TASKS_DIR_VAR)
        if directory:  # marks a killed predecessor left: no task runs before this one starts
            for stale in Path(directory).glob("*.running"):
                stale.unlink(missing_ok=True)

    def busy(self) -> bool:
        """Whether a ClientApp task is running."""
        return self.thread is not None and self.thread.is_alive()

    def get_eligible_capacity(
        self,
        supported_task_types: set[Any],
        *,
        insecure: bool = False,
        root_certificates_path: str | None = None,
    ) -> tuple[set[Any], set[str]]:
        """Flower's, without ClientApp tasks while one runs."""
        types, fabs = self.fallback.get_eligible_capacity(
            supported_task_types, insecure=insecure, root_certificates_path=root_certificates_path
        )
        if self.busy():
            types = {t for t in types if t != self.client_app}
        return types, fabs

    def wait_for_capacity(self, task_type: Any = None, **kwargs: Any) -> None:
        """Flower's."""
        self.fallback.wait_for_capacity(task_type, **kwargs)

    def launch(self, spec: Any) -> Any:
        """A ClientApp task on this process's thread; anything else on Flower's executor."""
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != self.client_app or spec.runtime_dependency_install or self.busy():
            return self.fallback.launch(spec)
        self.thread = threading.Thread(target=self.run, args=(spec,), name=f"task-{spec.task_id}")
        self.thread.start()
        return LaunchResult.accepted()

    def run(self, spec: Any) -> None:
        """``run_task``, then the task polls start over (the next message follows closely)."""
        try:
            run_task(spec, self.apps)
        finally:
            if self.polls is not None:
                self.polls.poll_now()

    def reconcile(self) -> None:
        """Flower's."""
        self.fallback.reconcile()

    def close(self) -> None:
        """Flower's."""
        self.fallback.close()


def install(run_superexec_module: Any, longest_poll: float | None = None) -> TaskPolls | None:
    """Make Flower's SuperExec loop build a ``WarmExecutor`` around the executor it asks for;
    with ``longest_poll``, its task polls back off up to it (``TaskPolls``, returned)."""
    flower_factory = getattr(run_superexec_module.get_executor, "flower_factory", None)
    flower_factory = flower_factory or run_superexec_module.get_executor
    polls = TaskPolls(longest_poll) if longest_poll is not None else None
    if polls is not None:
        run_superexec_module.time = polls

    def get_executor(*args: Any, **kwargs: Any) -> WarmExecutor:
        return WarmExecutor(flower_factory(*args, **kwargs), polls)

    get_executor.flower_factory = flower_factory  # type: ignore[attr-defined]
    run_superexec_module.get_executor = get_executor
    return polls


def hear_wakes(polls: TaskPolls, name: str) -> bool:
    """Poll at once whenever the SuperNode wakes this process on channel ``name``
    (``fedfm_flower.deploy.wake``) or a task ends, and otherwise every ``WOKEN_LONGEST_POLL_S``
    only; False, polls unchanged, when the channel cannot be opened."""

    if not wake.listen(name, polls.poll_now):
        return False
    polls.cap = max(polls.cap, WOKEN_LONGEST_POLL_S)
    polls.woken = True
    return True


def without_wake(arguments: Sequence[str]) -> list[str]:
    """``arguments`` without ``--wake NAME`` (ours; Flower's ``flower-superexec`` refuses it)."""
    kept: list[str] = []
    skip = False
    for argument in arguments:
        if skip:
            skip = False
        elif argument == "--wake":
            skip = True
        elif not argument.startswith("--wake="):
            kept.append(argument)
    return kept


def main(argv: Sequence[str] | None = None) -> int:
    """Run Flower's SuperExec loop with ``WarmExecutor``; Flower's own on another Flower."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.deploy.superexec", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--runtime-api-address", required=True)
    parser.add_argument("--insecure", action="store_true")
    parser.add_argument("--root-certificates", default=None)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--wake", default=None, help="the SuperNode's wake channel (its name)")
    args = parser.parse_args(arguments)
    try:
        longest_poll = longest_task_poll()
    except ValueError as err:
        parser.error(str(err))
    problem = unsupported_flower()
    if problem is not None:
        print(
            f"fedfm_flower.deploy.superexec: {problem}; running flower-superexec instead",
            file=sys.stderr,
            flush=True,
        )
        command = flower_command("flower-superexec")
        os.execvp(command, [command, *without_wake(arguments)])
        return 127  # execvp does not return; here only when it is replaced (tests)
    from flwr.supercore.superexec import run_superexec as loop

    polls = install(loop, longest_poll)
    if polls is not None and args.wake and not hear_wakes(polls, args.wake):
        print(
            f"fedfm_flower.deploy.superexec: cannot listen on wake channel {args.wake!r}; "
            "polling for tasks instead",
            file=sys.stderr,
            flush=True,
        )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per runtime request otherwise
    loop.run_superexec(
        runtime_api_address=args.runtime_api_address,
        insecure=args.insecure,
        root_certificates_path=args.root_certificates,
        parent_pid=args.parent_pid,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
