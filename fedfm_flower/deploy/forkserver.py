"""One process that imports the warm SuperExec's libraries once and forks a SuperExec per node.

    python -m fedfm_flower.deploy.forkserver --socket PATH [--preload MODULE ...]

Nearly all of a warm SuperExec's memory is its imports (~490 MB: torch, timm, peft, Flower;
``docs/benchmarks.md``), the same in every SuperNode's executor. On one machine that holds many
SuperNodes (a loopback deployment under load) this server imports them once, freezes what it
imported (``gc.freeze``: the children's collector then leaves those objects' pages alone) and,
on each request, forks a child that runs ``fedfm_flower.deploy.superexec`` with the requester's
arguments, environment, working directory and stdin/stdout/stderr. The imported pages stay
shared copy-on-write among the children until one of them writes to them. A real deployment
(one node per machine) does not need this: ``DeployOptions.shared_imports`` turns it on.

Protocol, over a Unix stream socket, one connection per SuperExec: the requester sends a 4-byte
big-endian length and a JSON object ``{"argv": [...], "env": {...}, "cwd": "..."}``, its three
stdio descriptors attached (``SCM_RIGHTS``); the server answers ``<pid>\\n`` once it has forked
and ``<status>\\n`` when the child ends (``subprocess.Popen.returncode``'s convention: ``-N`` for
signal N). When the requester's connection closes first (its SuperNode died or stopped) the
child is SIGKILLed, as a SuperNode's own SuperExec dies with its process group; a child whose
server dies is SIGKILLed by the kernel (``PR_SET_PDEATHSIG``). ``request_fork`` is the
requester's side; ``ExecutorKeeper`` (``fedfm_flower.deploy.supernode``) uses it when
``FEDFM_EXECUTOR_FORKSERVER`` names the socket, and starts the SuperExec as its own process when
the server cannot be reached.

The server has one thread: ``fork`` copies only the calling thread, so no lock held by another
thread can be left locked in a child. It never runs a torch operation itself, so no OpenMP
thread pool exists when it forks; each child sets torch's threads from its own environment.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedfm_flower.simulation.processes import pid_alive

FORKSERVER_VAR = "FEDFM_EXECUTOR_FORKSERVER"  # the socket a SuperNode's keeper asks for forks
# What a warm SuperExec imports before its first task (by weight: torch 281 MB, timm 135 MB,
# peft with transformers 60 MB, Flower's ClientApp modules 12 MB) and the project's ClientApp
# modules (installed, shared by every FAB of this project).
DEFAULT_PRELOAD = (
    "torch",
    "timm",
    "peft",
    "flwr.clientapp",
    "flwr.supercore.superexec.run_superexec",
    "flwr.supernode.runtime.run_clientapp",
    "fedfm_flower.deploy.superexec",
    "fedfm_flower.tasks.training",
    "fedfm_flower.models",
    "fedfm_flower.data",
)
TARGET = "fedfm_flower.deploy.superexec"  # the module whose main(argv) a child runs
HEADER = struct.Struct(">I")
MAX_REQUEST_BYTES = 4 * 2**20
# How long a requester waits for its fork, and the server for a request's bytes: long, because
# 30 SuperNodes starting on 2 cores ask at once (a 10 s wait ran out there).
REQUEST_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class ForkRequest:
    """What one SuperExec is started with."""

    argv: list[str]
    env: dict[str, str]
    cwd: str

    def encode(self) -> bytes:
        """The request's bytes on the socket: length, then JSON."""
        payload = json.dumps({"argv": self.argv, "env": self.env, "cwd": self.cwd}).encode()
        return HEADER.pack(len(payload)) + payload

    @classmethod
    def decode(cls, payload: bytes) -> ForkRequest:
        """A request from its JSON; ValueError naming what is malformed."""
        try:
            data = json.loads(payload)
        except json.JSONDecodeError as err:
            raise ValueError(f"not JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"not an object: {type(data).__name__}")
        argv, env, cwd = data.get("argv"), data.get("env"), data.get("cwd")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"argv must be a list of strings, not {argv!r}")
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise ValueError("env must map strings to strings")
        if not isinstance(cwd, str):
            raise ValueError(f"cwd must be a string, not {cwd!r}")
        return cls(argv, env, cwd)


class ForkedProcess:
    """A SuperExec forked by the server: its pid, and ``wait``/``poll`` as on ``Popen``."""

    def __init__(self, connection: socket.socket, pid: int) -> None:
        self.connection = connection
        self.pid = pid
        self.returncode: int | None = None

    def wait(self) -> int:
        """The child's exit status (``-N``: signal N), once it has ended."""
        if self.returncode is not None:
            return self.returncode
        line = _read_line(self.connection)
        self.connection.close()
        if line is None:  # the server died; the kernel has SIGKILLed its children
            while pid_alive(self.pid):
                time.sleep(0.2)
            self.returncode = -signal.SIGKILL
        else:
            self.returncode = int(line)
        return self.returncode

    def poll(self) -> int | None:
        """The exit status if the child has ended, else None."""
        if self.returncode is None:
            self.connection.setblocking(False)
            try:
                # a status line, or the server's end closed: either way, done
                self.connection.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return None
            finally:
                self.connection.setblocking(True)
            return self.wait()
        return self.returncode


def _read_line(connection: socket.socket) -> str | None:
    """One ``\\n``-ended line from ``connection``, or None at its end."""
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = connection.recv(1)
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data.decode().strip()


def request_fork(
    socket_path: str | os.PathLike[str],
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdio: Sequence[int] = (0, 1, 2),
    timeout: float = REQUEST_TIMEOUT_S,
) -> ForkedProcess:
    """A SuperExec forked by the server at ``socket_path`` with ``argv``, ``env``, ``cwd`` and
    the descriptors ``stdio`` (by default this process's); OSError when the server cannot be
    reached or refuses."""
    request = ForkRequest(list(argv), dict(os.environ if env is None else env), cwd or os.getcwd())
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(timeout)
        connection.connect(os.fspath(socket_path))
        _require_same_user(connection, socket_path)  # before the environment and fds go
        socket.send_fds(connection, [request.encode()], list(stdio))
        line = _read_line(connection)
        if line is None or not line.lstrip("-").isdigit() or int(line) <= 0:
            raise OSError(f"the fork server at {socket_path} refused the request ({line!r})")
        connection.settimeout(None)
    except BaseException:
        connection.close()
        raise
    return ForkedProcess(connection, int(line))


def _require_same_user(connection: socket.socket, socket_path: str | os.PathLike[str]) -> None:
    """OSError unless the process listening on ``connection``'s other end runs as this user
    (Linux's SO_PEERCRED): a request carries this process's environment and descriptors."""
    if not hasattr(socket, "SO_PEERCRED"):
        return
    credentials = connection.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
    )
    _, uid, _ = struct.unpack("3i", credentials)
    if uid != os.getuid():
        raise OSError(
            f"the fork server at {socket_path} runs as uid {uid}, not this user's {os.getuid()}: "
            "refusing to send it this process's environment"
        )


class ForkServer:
    """Accepts fork requests on a Unix socket; forks, reports and reaps the SuperExecs."""

    def __init__(
        self, socket_path: Path, target: str = TARGET, stop_with_parent: bool = False
    ) -> None:
        self.socket_path = socket_path
        self.target = target
        self.parent = os.getppid() if stop_with_parent else None
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}  # pid -> its requester's connection
        self.stopping = False

    def listen(self) -> None:
        """Bind the socket (owner only) and listen: requests may come from here on."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self.listener.bind(os.fspath(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        self.listener.listen(64)
        self.selector.register(self.listener, selectors.EVENT_READ)

    def serve(self) -> None:
        """Serve until SIGTERM or SIGINT; then stop the children (SIGTERM, then SIGKILL)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._stop)
        try:
            while not self.stopping:
                for key, _ in self.selector.select(timeout=0.2):
                    if key.fileobj is self.listener:
                        self._accept()
                    else:
                        self._requester_gone(key.data)
                self._reap()
                if self.parent is not None and os.getppid() != self.parent:
                    self.stopping = True  # the process that started this server is gone
        finally:
            self._stop_children()
            self.socket_path.unlink(missing_ok=True)

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _accept(self) -> None:
        connection, _ = self.listener.accept()
        try:
            connection.settimeout(REQUEST_TIMEOUT_S)
            request, fds = self._receive(connection)
        except (OSError, ValueError) as err:
            print(f"fedfm_flower.deploy.forkserver: bad request: {err}", file=sys.stderr)
            with contextlib.suppress(OSError):
                connection.sendall(b"0\n")
            connection.close()
            return
        # Blocked across the fork: a signal sent to the new pid before the child has restored
        # the default handlers waits for them instead of reaching the server's.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            pid = os.fork()
        except OSError as err:  # out of memory or processes: refused, the server serves on
            pid = -1
            print(f"fedfm_flower.deploy.forkserver: fork failed: {err}", file=sys.stderr)
        if pid == 0:
            self._child(request, fds)  # never returns
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        for fd in fds:
            os.close(fd)
        if pid < 0:
            with contextlib.suppress(OSError):
                connection.sendall(b"0\n")
            connection.close()
            return
        connection.settimeout(None)
        self.children[pid] = connection
        self.selector.register(connection, selectors.EVENT_READ, data=pid)
        try:
            connection.sendall(f"{pid}\n".encode())
        except OSError:  # the requester gave up waiting: its child is nobody's
            self._requester_gone(pid, force=True)

    @staticmethod
    def _receive(connection: socket.socket) -> tuple[ForkRequest, list[int]]:
        data, fds, _, _ = socket.recv_fds(connection, 65536, 3)
        try:
            return ForkServer._parse(connection, data, list(fds))
        except BaseException:
            for fd in fds:  # a refused request keeps none of the descriptors it brought
                os.close(fd)
            raise

    @staticmethod
    def _parse(
        connection: socket.socket, data: bytes, fds: list[int]
    ) -> tuple[ForkRequest, list[int]]:
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} descriptors attached, not 3 (stdin, stdout, stderr)")
        while len(data) < HEADER.size:
            more = connection.recv(65536)
            if not more:
                raise ValueError("the request ended early")
            data += more
        (length,) = HEADER.unpack(data[: HEADER.size])
        if length > MAX_REQUEST_BYTES:
            raise ValueError(f"a request of {length} bytes (the limit is {MAX_REQUEST_BYTES})")
        data = data[HEADER.size :]
        while len(data) < length:
            more = connection.recv(65536)
            if not more:
                raise ValueError("the request ended early")
            data += more
        return ForkRequest.decode(data[:length]), fds

    def _child(self, request: ForkRequest, fds: list[int]) -> None:
        code = 1
        try:
            for signum in (*STOP_SIGNALS, signal.SIGCHLD):
                signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            self.selector.close()
            self.listener.close()
            for connection in self.children.values():
                connection.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(request.cwd)
            os.environ.clear()
            os.environ.update(request.env)
            threads = request.env.get("OMP_NUM_THREADS", "")
            if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(int(threads))
            sys.argv = [self.target, *request.argv]
            code = importlib.import_module(self.target).main(request.argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _requester_gone(self, pid: int, force: bool = False) -> None:
        connection = self.children.get(pid)
        if connection is None:
            return
        try:
            if connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return  # a requester never writes after its request: stray bytes, not an end
        except BlockingIOError:
            if not force:
                return
        except OSError:
            pass  # reset by the peer: gone as well
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.selector.unregister(connection)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.children.pop(pid, None)
            if connection is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(connection)
            with contextlib.suppress(OSError):
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            connection.close()

    def _stop_children(self) -> None:
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.05)
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while self.children:
            self._reap()
            time.sleep(0.01)


def preload(modules: Sequence[str]) -> list[str]:
    """Import ``modules`` (one missing is skipped, with a line on stderr); the imported names."""
    imported = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            print(f"fedfm_flower.deploy.forkserver: not preloading {name}: {err}", file=sys.stderr)
        else:
            imported.append(name)
    gc.collect()
    gc.freeze()
    return imported


def main(argv: Sequence[str] | None = None) -> int:
    """Preload, then serve fork requests on ``--socket`` until SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.deploy.forkserver", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--socket", type=Path, required=True, help="the Unix socket to listen on")
    parser.add_argument(
        "--preload",
        nargs="*",
        default=list(DEFAULT_PRELOAD),
        help="modules imported before forking (default: torch, timm, peft, Flower's ClientApp "
        "modules, the project's)",
    )
    parser.add_argument(
        "--target", default=TARGET, help=f"the module whose main(argv) a child runs ({TARGET})"
    )
    parser.add_argument(
        "--stop-with-parent",
        action="store_true",
        help="stop (and stop the children) when the process that started this server ends",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    imported = preload(args.preload)
    server = ForkServer(args.socket.resolve(), args.target, args.stop_with_parent)
    server.listen()
    print(
        f"fedfm_flower.deploy.forkserver: serving on {server.socket_path} "
        f"({len(imported)} modules preloaded)",
        flush=True,
    )
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
