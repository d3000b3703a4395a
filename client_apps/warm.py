"""A warm worker per node: the per-message ClientApp hands its work to a long-lived process.

In deployment Flower 1.42 starts a fresh ``flwr-clientapp`` process for every message, which
pays the imports (flwr, torch, timm, peft), the model and the data each time (5.7-7 s here).
``warm_worker_mod``, the ClientApp's only mod, sends train and evaluate messages instead to a
worker process of the same node (``client_apps.warm_worker``) that keeps all of that loaded.

Choices (each with its reason):

* **Where.** Only in a ``flwr-clientapp`` process (deployment). Simulation's workers and the
  in-process test grid are warm already and never forward. Query messages are answered in the
  ClientApp (they import no torch), and then, unless the query was refused, start the worker
  when none is running, so round 1's training message usually finds it ready.
* **What travels.** The ``Message`` and the ``Context``, as Flower's own protobufs
  (``flwr.common.serde``), over an ``AF_UNIX`` stream socket, each frame prefixed by its 8-byte
  length. The worker calls the same ClientApp (the same handlers, fused messages included) and
  returns the reply ``Message`` and the updated ``Context``. The ClientApp adopts that context's
  ``state`` only once the whole reply has arrived.
* **Who may talk to it.** The socket lives in ``<tmp>/fedfm-warm-<uid>/``, a directory of mode
  0700 owned by the user (checked on every use; anything else is refused). Every request
  first presents the worker's random token, read from a 0600 file next to the socket and
  compared in constant time; the worker reads at most 256 bytes before that check. No network
  socket is opened. The socket is not kept in ``state-dir``: ``AF_UNIX`` paths are limited to
  107 bytes, so its name is a hash.
* **Which worker.** The name hashes the user, the interpreter, the app directory with the size
  and mtime of every file of ``client_apps/``, ``fedfm_flower/`` and ``pyproject.toml`` (in
  deployment the directory is the installed FAB's, named after the FAB's hash), the node config,
  and the ``flwr-clientapp``'s parent (the SuperNode's SuperExec: pid and start time). A new
  FAB, a code change or a restarted SuperNode therefore never reaches an old worker.
* **First use: start the worker, then wait for it.** A message that finds no worker starts one
  (``python -m client_apps.warm_worker``, detached in a session of its own; none when one is
  still starting) and waits up to ``READY_WAIT_S`` for its socket, then forwards. The worker
  imports about what the ClientApp would import itself, so waiting costs no more than doing
  the message here, and the two do not compete for the cores. Measured on the 2-core machine
  (busy, load 3-4), one fedavg training message with no worker running took 8.9 s waiting
  for the worker it started, and 23.0 s done in-process while that worker started beside it;
  13.5 s with no worker at all, 2.6 s with a warm one (``bench.warm_worker_message``). If the
  worker exits during its start, or is not ready in time, the message is done here.
* **Faults.** A dropped connection (the worker was killed or crashed mid-message), a refused or
  busy worker, or any protocol error: the message is done here, from the same context. The
  context's state was not touched, and training round *r* starts from the newest state saved
  *before* *r*. So a round-*r* file the dead worker may have written first changes nothing,
  and the rerun starts from the same state as the first attempt. A stale socket refuses
  connections, so the next message starts a new worker. If the handler raises in the worker,
  the message is done here again, so that Flower reports the exception the handler raises
  (the same exception for a deterministic error such as a bad config).
* **Lifecycle.** The worker exits at once (``os._exit``, mid-training included) when the
  ``flwr-clientapp``'s parent or grandparent ends (the SuperExec and the SuperNode, watched with
  pidfds); when the ClientApp that sent the message in progress hangs up (its work must not
  outlive it); on SIGTERM; and after ``warm-worker-idle-s`` without a message. It inherits the
  ClientApp's environment, so ``LocalDeployment`` finds it by its tag and stops it with the
  rest, and its stdout and stderr, so its log lines land where the ClientApp's did (the
  SuperNode's output; whoever reads that through a pipe sees its end only once the worker has
  exited too).
* **Concurrency.** One message at a time per worker. A second request while one is being
  handled gets "busy" at once and is done here, as Flower would have run it: in a process of
  its own.
* **Opt-out.** Node config ``warm-worker`` (bool, default ``true``) and ``warm-worker-idle-s``
  (seconds > 0, default 900), validated in every mode: a bad value fails the message with
  ``node config 'warm-worker' = 'yes' is invalid: ...``.

This module imports only the standard library and ``fedfm_flower.methods.settings`` (and flwr's
serde where it forwards), never torch: it runs in every ``flwr-clientapp`` process, before anything
knows whether it will forward.

Imports inside functions keep ``flwr.common`` and ``flwr.proto`` out of this module's start-up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfm_flower.methods.settings import ConfigError, coerce
from fedfm_flower.simulation.processes import pid_alive, proc_cmdline, proc_stat

if TYPE_CHECKING:
    from flwr.app import Context, Message

    Handler = Callable[[Message, Context], Message]

log = logging.getLogger(__name__)

ENABLED_KEY = "warm-worker"  # node config: forward to a warm worker (deployment only)
IDLE_KEY = "warm-worker-idle-s"  # node config: the worker exits after this many idle seconds
NODE = "node config"  # the source ConfigError names
DEFAULT_ENABLED = True
DEFAULT_IDLE_S = 900.0
READY_WAIT_S = 60.0  # how long a message waits for a worker it started before doing it here
HANDSHAKE_TIMEOUT_S = 10.0  # connecting, presenting the token, the worker's go/busy answer
SMALL_FRAME = 256  # the most a frame before authentication (token, operation) may hold
LARGE_FRAME = 1 << 36  # a sanity limit on a message or context (64 GiB)
APP_DIR = Path(__file__).resolve().parent.parent  # the Flower App (in deployment: the FAB's)
CODE_PATHS = ("client_apps", "fedfm_flower", "pyproject.toml")

# Worker replies to the handshake and to the request.
GO, BUSY, REFUSED, OK, RAISED = b"go", b"busy", b"refused", b"ok", b"raised"
RUN, PING = b"run", b"ping"

serving = False  # True in the worker process: its ClientApp runs the handlers itself


class WorkerUnavailable(RuntimeError):
    """No warm worker can be used for this message (the message is then handled in-process)."""


class ProtocolError(RuntimeError):
    """A frame that breaks the protocol: too large, or a connection closed mid-frame."""


# -- node config ----------------------------------------------------------------------------
@dataclass(frozen=True)
class WarmWorkerSettings:
    """The node config's ``warm-worker`` and ``warm-worker-idle-s``."""

    enabled: bool = DEFAULT_ENABLED
    idle_s: float = DEFAULT_IDLE_S

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> WarmWorkerSettings:
        """Parse and validate the two keys; a bad value raises ``ConfigError`` naming it."""
        enabled = coerce(ENABLED_KEY, node_config.get(ENABLED_KEY, DEFAULT_ENABLED), bool, NODE)
        raw_idle = node_config.get(IDLE_KEY, DEFAULT_IDLE_S)
        idle_s = coerce(IDLE_KEY, raw_idle, float, NODE)
        if not (math.isfinite(idle_s) and idle_s > 0):
            raise ConfigError(IDLE_KEY, raw_idle, "expected seconds > 0", source=NODE)
        return cls(enabled, idle_s)


# -- where the worker listens -----------------------------------------------------------------
def private_directory() -> Path:
    """``<tmp>/fedfm-warm-<uid>``, created with mode 0700 (see ``check_private``)."""
    uid = os.getuid()
    path = Path(tempfile.gettempdir()) / f"fedfm-warm-{uid}"
    if len(str(path)) > 60:  # keep the socket path far below AF_UNIX's 107 bytes
        path = Path("/tmp") / f"fedfm-warm-{uid}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    return check_private(path)


def check_private(path: Path) -> Path:
    """``path`` if it is a directory (not a link) of this user that nobody else may enter."""
    uid = os.getuid()
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise WorkerUnavailable(
            f"{path} is not a private directory of user {uid} (mode {stat.filemode(info.st_mode)}"
            f", owner {info.st_uid}); remove it to use warm workers"
        )
    return path


def code_version(app_dir: Path = APP_DIR) -> str:
    """A hash of the app directory and the size and mtime of every file the worker imports."""
    digest = hashlib.sha256(str(app_dir).encode())
    for name in CODE_PATHS:
        root = app_dir / name
        for path in sorted(_files(root)) if root.is_dir() else [root]:
            with contextlib.suppress(OSError):
                info = path.stat()
                digest.update(
                    f"{path.relative_to(app_dir)}:{info.st_size}:{info.st_mtime_ns};".encode()
                )
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    found = []
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            if entry.name != "__pycache__":
                found += _files(Path(entry.path))
        elif entry.name.endswith((".py", ".toml", ".json")):
            found.append(Path(entry.path))
    return found


def parent_chain(depth: int = 2) -> tuple[int, ...]:
    """This process's parent and grandparent (the SuperExec and the SuperNode of a ClientApp)."""
    pids: list[int] = []
    pid = os.getpid()
    for _ in range(depth):
        fields = proc_stat(pid)
        pid = int(fields[1]) if fields else (os.getppid() if pid == os.getpid() else 0)
        if pid <= 1:
            break
        pids.append(pid)
    return tuple(pids)


def node_key(node_config: Mapping[str, Any]) -> str:
    """The worker name for this node, code and SuperNode (see the module docstring)."""
    parent = os.getppid()
    fields = proc_stat(parent)
    parts = {
        "uid": os.getuid(),
        "python": sys.executable,
        "code": code_version(),
        "node-config": sorted((str(k), repr(v)) for k, v in node_config.items()),
        "parent": parent,
        "parent-start": fields[19] if len(fields) > 19 else "",
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Endpoint:
    """One worker's files: ``<key>.sock``, ``<key>.token`` (0600), ``<key>.lock`` (its pid)."""

    directory: Path
    key: str

    @classmethod
    def for_key(cls, key: str) -> Endpoint:
        """The endpoint ``key`` in the user's private directory."""
        return cls(private_directory(), key)

    @classmethod
    def for_node(cls, context: Context) -> Endpoint:
        """This node's endpoint, as a ``flwr-clientapp`` process computes it."""
        return cls.for_key(node_key(context.node_config))

    @property
    def socket_path(self) -> Path:
        """The worker's Unix socket."""
        return self.directory / f"{self.key}.sock"

    @property
    def token_path(self) -> Path:
        """The token every request presents (mode 0600)."""
        return self.directory / f"{self.key}.token"

    @property
    def lock_path(self) -> Path:
        """Locked by the live worker for its lifetime; holds its pid."""
        return self.directory / f"{self.key}.lock"

    def files(self) -> tuple[Path, Path, Path]:
        """The socket, the token and the lock file."""
        return (self.socket_path, self.token_path, self.lock_path)

    def worker_pid(self) -> int | None:
        """The pid of the worker that last took the lock (alive or not), if any."""
        try:
            return int(self.lock_path.read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def connect(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> socket.socket | None:
        """A connection to the worker, or None when none listens (no socket, or a stale one)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(self.socket_path))
        except OSError:
            sock.close()
            return None
        return sock

    def token(self) -> bytes:
        """The worker's current token."""
        return self.token_path.read_bytes().strip()

    def spawn(
        self, watch: Sequence[int], idle_s: float, preload: bool = True
    ) -> subprocess.Popen[bytes]:
        """Start a worker for this endpoint, detached (own session), watching ``watch``."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(APP_DIR), env.get("PYTHONPATH")) if p)
        command = [
            sys.executable,
            "-m",
            "client_apps.warm_worker",
            "--directory",
            str(self.directory),
            "--key",
            self.key,
            "--idle-s",
            repr(idle_s),
            *[f"--watch={pid}" for pid in watch],
            *([] if preload else ["--no-preload"]),
        ]
        process = subprocess.Popen(
            command,
            cwd=str(APP_DIR),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        _spawned.append(process)
        log.info("started a warm worker (pid %d) for %s", process.pid, self.socket_path)
        return process

    def live_worker_pid(self) -> int | None:
        """The pid of this endpoint's worker while it runs (starting or serving), else None."""
        pid = self.worker_pid()
        if pid is None or not pid_alive(pid):
            return None
        command = "\0".join(proc_cmdline(pid))
        mine = "client_apps.warm_worker" in command and self.key in command
        return pid if mine else None

    def wait_until_ready(
        self, process: subprocess.Popen[bytes] | None, wait_s: float
    ) -> socket.socket | None:
        """Poll for a connection for up to ``wait_s``; None when the time runs out, or when
        neither ``process`` nor another worker of this endpoint is still starting."""
        deadline = time.monotonic() + wait_s
        while True:
            sock = self.connect()
            if sock is not None:
                return sock
            starting = process is not None and process.poll() is None
            if not starting and self.live_worker_pid() is None:
                log.warning(
                    "the warm worker exited during its start (exit status %s; its output is in "
                    "this SuperNode's log); handling the message in this process",
                    None if process is None else process.returncode,
                )
                return None
            if time.monotonic() >= deadline:
                log.warning(
                    "no warm worker ready after %.0f s; handling the message in this process",
                    wait_s,
                )
                return None
            time.sleep(0.05)


_spawned: list[subprocess.Popen[bytes]] = []  # keeps started workers' Popen objects alive


# -- framing ----------------------------------------------------------------------------------
def send_frames(sock: socket.socket, *payloads: bytes) -> None:
    """Send each payload prefixed by its length (8 bytes, big-endian)."""
    for payload in payloads:
        sock.sendall(struct.pack(">Q", len(payload)))
        sock.sendall(payload)


def recv_frame(sock: socket.socket, limit: int) -> bytes:
    """Receive one frame of at most ``limit`` bytes (``ProtocolError`` beyond it or on EOF)."""
    (size,) = struct.unpack(">Q", _recv_exact(sock, 8))
    if size > limit:
        raise ProtocolError(f"a frame of {size} bytes exceeds the limit of {limit}")
    return bytes(_recv_exact(sock, size))


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:], size - received)
        if count == 0:
            raise ProtocolError("the connection closed mid-frame")
        received += count
    return buffer


# -- the ClientApp side -----------------------------------------------------------------------
def ping(endpoint: Endpoint, token: bytes | None = None) -> bytes | None:
    """The worker's answer to a ping presenting ``token`` (default: its own token): ``ok`` or
    ``refused``; None when no worker listens or the connection fails."""
    sock = endpoint.connect()
    if sock is None:
        return None
    with sock:
        try:
            send_frames(sock, endpoint.token() if token is None else token, PING)
            return recv_frame(sock, SMALL_FRAME)
        except (OSError, ProtocolError):
            return None


def in_clientapp_process() -> bool:
    """True in a ``flwr-clientapp`` process (deployment's one process per message)."""
    return Path(sys.argv[0]).name == "flwr-clientapp" and hasattr(socket, "AF_UNIX")


@dataclass(frozen=True)
class SpawnSpec:
    """How a message that finds no worker starts one: pids it watches, its idle timeout."""

    watch: tuple[int, ...]
    idle_s: float = DEFAULT_IDLE_S
    preload: bool = True  # import torch, timm, peft before listening (tests may skip it)


def ensure_worker(endpoint: Endpoint, spawn: SpawnSpec) -> subprocess.Popen[bytes] | None:
    """Start a worker for ``endpoint`` unless one accepts connections or is starting; returns
    the new one."""
    sock = endpoint.connect()
    if sock is not None:
        sock.close()
        return None
    if endpoint.live_worker_pid() is not None:
        return None  # one is starting
    return endpoint.spawn(spawn.watch, spawn.idle_s, spawn.preload)


def forward(
    message: Message,
    context: Context,
    endpoint: Endpoint,
    *,
    spawn: SpawnSpec | None = None,
    wait_s: float = READY_WAIT_S,
    on_sent: Callable[[], None] | None = None,
) -> Message | None:
    """The worker's reply to ``message`` (``context.state`` updated from the worker), or None:
    then nothing was changed and the caller handles the message itself.

    With no worker listening, ``spawn`` starts one and the message waits up to ``wait_s`` for
    it (0: do not wait). ``on_sent`` is called once the request is on its way (tests use it to
    kill the worker mid-message).
    """
    from flwr.common.serde import context_to_proto, message_to_proto

    started = time.perf_counter()
    sock = endpoint.connect()
    if sock is None:
        if spawn is None:
            return None
        try:  # a worker started by an earlier message (a query) may still be importing
            process = ensure_worker(endpoint, spawn)
        except OSError as err:
            log.warning("could not start a warm worker (%s); handling the message here", err)
            return None
        if wait_s <= 0:
            return None
        sock = endpoint.wait_until_ready(process, wait_s)
        if sock is None:
            return None
    waited = time.perf_counter() - started
    request = (
        message_to_proto(message).SerializeToString(),
        context_to_proto(context).SerializeToString(),
    )
    with sock:
        try:
            return _exchange(sock, endpoint, request, context, on_sent, started, waited)
        except (OSError, ProtocolError, ValueError) as err:
            # ValueError covers protobuf's DecodeError (a reply cut short or garbled).
            log.warning(
                "the warm worker dropped the %s message (%s: %s); handling it in this process, "
                "the next message starts a new worker",
                message.metadata.message_type,
                type(err).__name__,
                err,
            )
            return None


def _exchange(
    sock: socket.socket,
    endpoint: Endpoint,
    request: tuple[bytes, bytes],
    context: Context,
    on_sent: Callable[[], None] | None,
    started: float,
    waited: float,
) -> Message | None:
    from flwr.common.serde import context_from_proto, message_from_proto
    from flwr.proto.message_pb2 import Context as ProtoContext
    from flwr.proto.message_pb2 import Message as ProtoMessage

    send_frames(sock, endpoint.token(), RUN)
    answer = recv_frame(sock, SMALL_FRAME)
    if answer != GO:
        log.warning(
            "the warm worker answered %r; handling the message in this process",
            answer.decode(errors="replace"),
        )
        return None
    send_frames(sock, *request)
    if on_sent is not None:
        on_sent()
    sock.settimeout(None)  # training takes as long as it takes; a dead worker closes the socket
    status = recv_frame(sock, SMALL_FRAME)
    if status == RAISED:
        error = recv_frame(sock, LARGE_FRAME).decode(errors="replace")
        log.warning(
            "the ClientApp raised in the warm worker (%s); handling the message in this process "
            "so that Flower reports the exception itself",
            error,
        )
        return None
    if status != OK:
        raise ProtocolError(f"unexpected status {status!r}")
    reply = message_from_proto(ProtoMessage.FromString(recv_frame(sock, LARGE_FRAME)))
    updated = context_from_proto(ProtoContext.FromString(recv_frame(sock, LARGE_FRAME)))
    context.state = updated.state
    log.info(
        "warm worker handled the %s message in %.3f s (%.3f s waiting for it to start)",
        reply.metadata.message_type,
        time.perf_counter() - started,
        waited,
    )
    return reply


def handle(
    message: Message,
    context: Context,
    call_next: Handler,
    endpoint: Endpoint,
    spawn: SpawnSpec | None,
    *,
    wait_s: float = READY_WAIT_S,
    on_sent: Callable[[], None] | None = None,
) -> Message:
    """Forward ``message`` to the worker at ``endpoint``, or run ``call_next`` here when that
    yields no reply. Queries always run here, and start a worker when none is running."""
    if message.metadata.message_type.split(".")[0] == "query":
        # Answered first: a node the query refuses (its partition-id out of range, a bad run
        # config) starts no worker.
        reply = call_next(message, context)
        if spawn is not None and not reply.has_error():
            with contextlib.suppress(OSError):
                ensure_worker(endpoint, spawn)
        return reply
    reply = forward(message, context, endpoint, spawn=spawn, wait_s=wait_s, on_sent=on_sent)
    return reply if reply is not None else call_next(message, context)


def warm_worker_mod(message: Message, context: Context, call_next: Handler) -> Message:
    """Flower mod: in a ``flwr-clientapp`` process, hand the message to this node's warm worker
    (``warm-worker``, default true); elsewhere, or when that fails, run the handler here."""
    settings = WarmWorkerSettings.from_node_config(context.node_config)  # a bad value fails
    if serving or not settings.enabled or not in_clientapp_process():
        return call_next(message, context)
    try:
        endpoint = Endpoint.for_node(context)
    except (WorkerUnavailable, OSError) as err:
        log.warning("no warm worker (%s); handling the message in this process", err)
        return call_next(message, context)
    return handle(message, context, call_next, endpoint, SpawnSpec(parent_chain(), settings.idle_s))
