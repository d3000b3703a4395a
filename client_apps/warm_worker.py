"""The warm worker: a long-lived process that runs one node's ClientApp messages.

    python -m client_apps.warm_worker --directory DIR --key KEY [--watch PID ...] [--idle-s S]

A ``flwr-clientapp`` process starts it (``client_apps.warm``, which also explains the design);
nobody else needs to. In order, it:

1. watches the ``--watch`` pids (pidfds) and exits at once when one of them ends, before
   anything else, so that it never outlives its SuperNode, not even while importing;
2. takes ``<key>.lock`` (``flock``) and writes its pid there, or exits when another worker
   holds it; removes the files of workers killed over an hour ago (their locks are free);
3. imports the ClientApp and the modules every message needs (torch, the client runtime, the
   records);
4. writes a fresh random token to ``<key>.token`` (0600), then binds ``<key>.sock`` (0600 in a
   0700 directory); a connectable socket means a ready worker;
5. serves. A connection thread checks the token (constant-time compare) and answers ``go``, or
   ``busy`` while a message is being handled (until its reply is ready to send). The main
   thread runs the message through the ClientApp, exactly as ``flwr-clientapp`` would, and
   replies with the reply ``Message`` and the updated ``Context``. While the handler runs, a
   guard exits the process if the requesting ClientApp hangs up: its message is dead, and its
   work must not go on (no state written after it).
6. exits after ``--idle-s`` seconds without a message. Whenever it exits by itself it removes
   its socket, token and lock file (after a SIGKILL the next worker replaces them).

Imports inside functions keep ``flwr.app``, ``flwr.clientapp``, ``flwr.common``, ``flwr.proto``
and ``numpy`` out of this module's start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hmac
import importlib
import logging
import os
import queue
import secrets
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from client_apps import warm
from client_apps.warm import (
    BUSY,
    GO,
    LARGE_FRAME,
    OK,
    PING,
    RAISED,
    REFUSED,
    RUN,
    SMALL_FRAME,
    Endpoint,
    ProtocolError,
    recv_frame,
    send_frames,
)
from fedfm_flower.simulation.processes import pid_alive

log = logging.getLogger("client_apps.warm_worker")

PAYLOAD_TIMEOUT_S = 120.0  # the most the request's message and context may take to arrive
PRELOAD = (  # what every message of the ViT and LLM families imports (~90% of a cold start)
    "client_apps.app",
    "client_apps.base",
    "client_apps.faults",
    "fedfm_flower.records.messages",
    "fedfm_flower.tasks.training",
    "timm",
    "peft",
)


def exit_when_gone(pids: Sequence[int]) -> None:
    """End this process (``os._exit``) as soon as any of ``pids`` ends; returns at once."""
    if not pids:
        return
    fds: list[int] = []
    try:
        for pid in pids:
            fds.append(os.pidfd_open(pid))
    except ProcessLookupError:
        _die(f"watched process {pid} is gone", 0)
    except (AttributeError, OSError):  # no pidfds (old kernel): poll /proc instead
        fds = []

    def by_pidfd() -> None:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll()
        _die("a watched process (the SuperNode or its SuperExec) ended", 0)

    def by_polling() -> None:
        while all(pid_alive(pid) for pid in pids):
            time.sleep(0.2)
        _die("a watched process (the SuperNode or its SuperExec) ended", 0)

    target = by_pidfd if fds else by_polling
    threading.Thread(target=target, name="watch-parents", daemon=True).start()


_owned: list[Path] = []  # the endpoint's files, once this process holds its lock


def _die(reason: str, code: int) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"warm worker {os.getpid()}: {reason}; exiting now\n".encode())
    remove_files(_owned)
    os._exit(code)


def remove_files(paths: Sequence[Path]) -> None:
    """Remove these files where they exist."""
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def hangup_guard(conn: socket.socket) -> Iterator[None]:
    """While the block runs, exit the process if the peer hangs up (its ClientApp died)."""
    wake_read, wake_write = os.pipe()

    def watch() -> None:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN | select.POLLRDHUP | select.POLLHUP)
        poller.register(wake_read, select.POLLIN)
        events = poller.poll()
        if not any(fd == wake_read for fd, _ in events):
            _die("the ClientApp that sent the message in progress hung up", 3)

    thread = threading.Thread(target=watch, name="hangup-guard", daemon=True)
    thread.start()
    try:
        yield
    finally:
        os.write(wake_write, b"x")
        thread.join()
        os.close(wake_read)
        os.close(wake_write)


def take_lock(endpoint: Endpoint) -> int | None:
    """The endpoint's lock, held for the process's lifetime (its pid written in), or None."""
    fd = os.open(endpoint.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def prune_stale(directory: Path, keep: Endpoint, older_than_s: float = 3600.0) -> int:
    """Remove the files of workers that were killed (no lock held) over ``older_than_s`` ago;
    returns how many endpoints were cleaned."""
    cleaned = 0
    for lock_path in directory.glob("*.lock"):
        endpoint = Endpoint(directory, lock_path.stem)
        if endpoint.key == keep.key:
            continue
        try:
            if time.time() - lock_path.stat().st_mtime < older_than_s:
                continue
            fd = os.open(lock_path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live worker
        remove_files(endpoint.files())
        os.close(fd)
        cleaned += 1
    return cleaned


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600, atomically (temporary file, rename)."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(temporary, path)


def _close_after_reading(conn: socket.socket, limit: int = 2 * SMALL_FRAME) -> None:
    """Let the peer read what was sent before this end closes: a socket closed with unread
    bytes (the refused request's operation frame) resets the connection, and the reset can
    discard the answer before the peer reads it. Reads what the peer sent, up to ``limit``
    bytes and the handshake's timeout, after shutting down this end's writes."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        read = 0
        while read < limit:
            chunk = conn.recv(4096)
            if not chunk:
                return
            read += len(chunk)


class Worker:
    """The serving loop of one endpoint (see the module docstring)."""

    def __init__(self, endpoint: Endpoint, idle_s: float) -> None:
        self.endpoint = endpoint
        self.idle_s = idle_s
        self.token = secrets.token_hex(32).encode()
        self.busy = threading.Lock()  # held from the "go" until the reply is ready to send
        self.jobs: queue.Queue[socket.socket] = queue.Queue()
        self.listener: socket.socket | None = None

    def bind(self) -> None:
        """Write the token, then listen on the socket (replacing a stale one)."""
        write_private(self.endpoint.token_path, self.token + b"\n")
        path = self.endpoint.socket_path
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(16)
        self.listener = listener

    def serve(self) -> None:
        """Handle messages on this (main) thread until idle for ``idle_s``."""
        threading.Thread(target=self._accept, name="accept", daemon=True).start()
        log.info("warm worker %d ready on %s", os.getpid(), self.endpoint.socket_path)
        while True:
            try:
                conn = self.jobs.get(timeout=self.idle_s)
            except queue.Empty:
                if self.busy.acquire(blocking=False):
                    break
                continue
            self._run(conn)
        log.info("warm worker %d idle for %.0f s; exiting", os.getpid(), self.idle_s)
        self.close()

    def close(self) -> None:
        """Stop listening; remove the socket, the token and the lock file."""
        if self.listener is not None:
            self.listener.close()
        remove_files(self.endpoint.files())

    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(conn,), daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        """Token, then the operation: ``ping`` is answered here, ``run`` queued when idle."""
        queued = False
        try:
            conn.settimeout(warm.HANDSHAKE_TIMEOUT_S)
            if not conn.recv(1, socket.MSG_PEEK):
                return  # a readiness probe: connected, then closed
            token = recv_frame(conn, SMALL_FRAME)
            if not hmac.compare_digest(token, self.token):
                log.warning("refused a request with a wrong token")
                send_frames(conn, REFUSED)
                _close_after_reading(conn)
                return
            operation = recv_frame(conn, SMALL_FRAME)
            if operation == PING:
                send_frames(conn, OK)
            elif operation == RUN:
                if not self.busy.acquire(blocking=False):
                    send_frames(conn, BUSY)
                    return
                try:
                    send_frames(conn, GO)
                except OSError:
                    self.busy.release()
                    raise
                self.jobs.put(conn)
                queued = True
            else:
                send_frames(conn, REFUSED)
        except (OSError, ProtocolError) as err:
            log.warning("dropped a connection during its handshake: %s", err)
        finally:
            if not queued:
                conn.close()

    def _run(self, conn: socket.socket) -> None:
        """Receive the message and context, run the ClientApp, send the reply and context."""
        from flwr.common.serde import (
            context_from_proto,
            context_to_proto,
            message_from_proto,
            message_to_proto,
        )
        from flwr.proto.message_pb2 import Context as ProtoContext
        from flwr.proto.message_pb2 import Message as ProtoMessage

        from client_apps.app import app

        released = False
        try:
            conn.settimeout(PAYLOAD_TIMEOUT_S)
            message_bytes = recv_frame(conn, LARGE_FRAME)
            context_bytes = recv_frame(conn, LARGE_FRAME)
            conn.settimeout(None)
            started = time.perf_counter()
            with hangup_guard(conn):
                message = message_from_proto(ProtoMessage.FromString(message_bytes))
                context = context_from_proto(ProtoContext.FromString(context_bytes))
                del message_bytes, context_bytes
                try:
                    reply = app(message, context)
                except Exception as err:  # noqa: BLE001 - the ClientApp redoes it to report it
                    log.exception("the ClientApp raised in the warm worker")
                    send_frames(conn, RAISED, f"{type(err).__name__}: {err}".encode())
                    return
            answer = (
                message_to_proto(reply).SerializeToString(),
                context_to_proto(context).SerializeToString(),
            )
            # Free before the reply goes out: a ClientApp that has read it may send the node's
            # next message at once, and must not find the worker busy with this one's last
            # steps (the sending, the log line). A message accepted from here on waits in
            # ``jobs`` until this one is done, as this thread runs one message at a time.
            self.busy.release()
            released = True
            send_frames(conn, OK, *answer)
            log.info(
                "%s message handled in %.3f s",
                message.metadata.message_type,
                time.perf_counter() - started,
            )
        except (OSError, ProtocolError, ValueError) as err:
            log.warning("dropped a request: %s: %s", type(err).__name__, err)
        finally:
            conn.close()
            if not released:
                self.busy.release()


def preload() -> None:
    """Import what every message needs, so that the first one is warm too."""

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as err:  # the message itself will report it
            log.warning("could not preload %s: %s", name, err)


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--watch", type=int, action="append", default=[])
    parser.add_argument("--idle-s", type=float, default=warm.DEFAULT_IDLE_S)
    parser.add_argument("--no-preload", action="store_true", help="import on first use only")
    args = parser.parse_args(argv)
    exit_when_gone(args.watch)
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(levelname)s warm-worker[{os.getpid()}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    log.setLevel(logging.INFO)
    endpoint = Endpoint(warm.check_private(args.directory), args.key)
    lock = take_lock(endpoint)
    if lock is None:
        log.info("another warm worker serves %s; exiting", endpoint.socket_path)
        return 0
    _owned.extend(endpoint.files())
    signal.signal(signal.SIGTERM, lambda signum, frame: _die("stopped (SIGTERM)", 0))
    prune_stale(endpoint.directory, endpoint)
    warm.serving = True
    if not args.no_preload:
        preload()
    worker = Worker(endpoint, args.idle_s)
    worker.bind()
    worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
