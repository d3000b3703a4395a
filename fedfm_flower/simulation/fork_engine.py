"""A simulation backend whose workers are forked from one process that imported the ClientApp's
libraries once: Flower's engine without Ray, for simulations on the CPU.

Flower's simulation engine runs each message's ClientApp through a ``Backend``; the only one it
builds is Ray's (``RayBackend``: a Ray cluster started for the run, one actor process per
client slot). Each actor is a fresh Python process that imports torch, timm, peft and the client
code (about 6.5 CPU s each on the 2-core machine), and Ray's own processes add about 3 CPU s,
all before round 1 can end (``docs/benchmarks.md``, start-up). ``ForkBackend`` instead uses
one ``fedfm_flower.deploy.forkserver``, which imports those libraries once and forks one
``fedfm_flower.simulation.fork_worker`` per slot on its first message; the imported pages stay
shared copy-on-write among the workers. The server is the one the launcher
(``fedfm_flower.simulation.launcher``) started before ``flwr run`` (``SERVER_VAR``; it preloads
only the libraries, so its imports overlap Flower's start-up and the workers import the project's
code from the run's app), else one the backend starts when the engine builds it.

What stays as with Ray:

- *Slots*: ``int(CPUs / client_resources.num_cpus)``, the CPUs being ``init_args.num_cpus`` when
  given, else those this process may use (its affinity, capped by a cgroup quota), as
  ``pool_size_from_resources`` counts a local Ray's; none fitting is an error naming both.
- *A worker's environment*: the simulation process's, with ``OMP_NUM_THREADS`` set to the
  client's CPUs unless set (as Ray sets it for an actor) and no visible CUDA device (as Ray
  hides them from an actor that asked for none), and ``sys.path`` from the simulation process.
- *Failures*: a ClientApp that raises fails its message with ``ClientAppException`` and one that
  cannot be loaded with ``LoadClientAppError`` (the engine turns either into an error reply, as
  for Ray); a worker that dies fails the message it ran (``ClientAppException`` naming its exit
  status) and is forked again for the next one.

Used only where it can stand in for Ray (``eligible``): clients that ask for no GPU (GPU shares
stay Ray's, which schedules the fractions; not built here), no ``RAY_ADDRESS`` naming a cluster,
a platform with ``fork`` and descriptor passing, and ``FEDFM_SIMULATION_ENGINE`` not ``ray``.
``install`` (called when the simulation process loads the ClientApp's module, which Flower
1.42's ``start_vce`` does before it runs the engine) wraps the engine module's ``run_api``: where
``eligible`` says yes for the config that ``start_vce``'s ``backend_fn`` closes over, the engine
gets a ``ForkBackend`` instead of that function's ``RayBackend``. Flower's ``RayBackend`` itself
is left as it is, for anything else that builds one. Guarded like
``fedfm_flower.simulation.prompt_engine``: only over the ``start_vce`` and ``run_api`` this module
was written against (``FLOWER_SOURCES``). What a ClientApp computes does not change: the same
messages with the same contexts reach the same app (``tests/test_simulation.py`` compares every
round with Ray's).

Imports inside functions keep ``flwr.clientapp`` out of this module's start-up; they load
``fedfm_flower.deploy.forkserver`` only when used (runs as a program, ``python -m``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fedfm_flower.simulation.fork_worker import ChannelClosed, receive_frame, send_frame
from fedfm_flower.simulation.processes import pid_alive
from fedfm_flower.simulation.prompt_engine import unknown_sources

log = logging.getLogger("fedfm_flower")

ENGINE_MODULE = "flwr.server.superlink.fleet.vce.vce_api"  # loaded only in the simulation process
ENV_SWITCH = "FEDFM_SIMULATION_ENGINE"  # "fork" (the default where eligible) or "ray"
WORKER_MODULE = "fedfm_flower.simulation.fork_worker"
# sha256 (first 16 hex digits) of inspect.getsource of what this module relies on: start_vce
# passes run_api a backend_fn that closes over the parsed backend config (``backend_config``)
# and builds the RayBackend; run_api builds the backend with it and runs the engine's threads.
FLOWER_SOURCES = {"start_vce": {"2d5e267f893950a7"}, "run_api": {"f85c0cd6e902752f"}}
# What the fork server imports before it forks: the ClientApp's heavy libraries (as the Ray
# actors' preload, ``fedfm_flower.simulation.actor_preload.PRELOADED``) and Flower's ClientApp.
PRELOAD = (
    "torch",
    "timm.models.vision_transformer",
    "peft",
    "flwr.clientapp",
    "client_apps.base",
    "fedfm_flower.methods.halves",
    WORKER_MODULE,
)
# A fork server the launcher started before ``flwr run`` (``"<pid>:<socket>"``), so that its
# imports overlap Flower's start-up; it preloads only libraries, none of the project's code,
# which the workers import from the run's own app (the FAB Flower installed).
SERVER_VAR = "FEDFM_SIMULATION_FORKSERVER"
LIBRARIES = ("torch", "timm.models.vision_transformer", "peft", "flwr.clientapp")
READY_TIMEOUT_S = 300.0  # the fork server's imports on a loaded machine
STOP_GRACE_S = 5.0


class ForkEngineError(RuntimeError):
    """The fork backend cannot run a message (its fork server is gone, a worker cannot start)."""


def available_cpus() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus or 1, max(1, int(int(quota) / int(period))))
    return max(1, cpus or 1)


def client_resources(backend_config: Mapping[str, Any]) -> dict[str, float]:
    """The clients' ``num_cpus`` and ``num_gpus`` as Flower's RayBackend reads them (its
    defaults: 2 CPUs, no GPU); ValueError naming a value that is not a number."""
    given = dict(backend_config.get("client_resources") or {"num_cpus": 2, "num_gpus": 0.0})
    resources = {"num_cpus": given.get("num_cpus", 1), "num_gpus": given.get("num_gpus", 0.0)}
    for key, value in resources.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"client resources: {key} must be a number, not {value!r}")
    if resources["num_cpus"] <= 0:
        raise ValueError(f"client resources: num_cpus must be > 0, not {resources['num_cpus']}")
    return {key: float(value) for key, value in resources.items()}


def slots(backend_config: Mapping[str, Any]) -> int:
    """How many ClientApps run at once: the CPUs over each client's, as Ray's actor pool."""
    init_args = backend_config.get("init_args") or {}
    cpus = init_args.get("num_cpus") or available_cpus()
    num_cpus = client_resources(backend_config)["num_cpus"]
    count = int(cpus / num_cpus)
    if count < 1:
        raise ValueError(
            f"no ClientApp fits: {cpus} CPUs, and each client asks for num_cpus={num_cpus:g}"
        )
    return count


def chosen_engine(env: Mapping[str, str]) -> str:
    """``ENV_SWITCH``'s value, ``fork`` when unset; ValueError naming any other value."""
    value = env.get(ENV_SWITCH, "fork") or "fork"
    if value not in ("fork", "ray"):
        raise ValueError(f"{ENV_SWITCH}={value!r} is invalid: use 'fork' or 'ray'")
    return value


def eligible(backend_config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> bool:
    """Whether ``ForkBackend`` stands in for Ray for this backend config (module docstring);
    ValueError for an invalid ``ENV_SWITCH``."""
    env = os.environ if env is None else env
    if chosen_engine(env) == "ray":
        return False
    if env.get("RAY_ADDRESS", "local") not in ("", "local"):
        return False
    if not (hasattr(os, "fork") and hasattr(socket, "send_fds")):
        return False
    try:
        return client_resources(backend_config)["num_gpus"] == 0
    except ValueError:
        return False  # Ray's own validation reports it


def app_reference(app: Any) -> tuple[str, str]:
    """``(module, attribute)`` under which a loaded module holds ``app``; ForkEngineError when
    none does (the worker imports the app by name rather than unpickling it)."""
    for name, module in list(sys.modules.items()):
        for attribute, value in list(getattr(module, "__dict__", {}).items()):
            if value is app and not attribute.startswith("_"):
                return name, attribute
    raise ForkEngineError(f"no loaded module holds the ClientApp {app!r} by name")


def worker_environment(num_cpus: float, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A worker's environment: ``base``'s, with the client's threads and no CUDA device."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", str(max(1, int(num_cpus))))
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([*sys.path, *filter(None, [env.get("PYTHONPATH", "")])])
    return env


class ForkServerProcess:
    """A fork server this process started (the backend, or the launcher): its process, its
    socket, and whether it is ready."""

    def __init__(self, env: Mapping[str, str], preload: tuple[str, ...] = PRELOAD) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="fedfm-fork-"))  # mode 0700
        self.socket_path = self.directory / "fork.sock"
        self.ready = threading.Event()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fedfm_flower.deploy.forkserver",
                "--socket",
                str(self.socket_path),
                "--target",
                WORKER_MODULE,
                "--stop-with-parent",
                "--preload",
                *preload,
            ],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._watch, name="fedfm-forkserver-out", daemon=True).start()

    def _watch(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if "serving on" in line:
                self.ready.set()
            else:
                sys.stdout.write(line)
        self.ready.set()  # ended: ``wait_ready`` finds it gone

    def variable(self) -> str:
        """``SERVER_VAR``'s value naming this server to the simulation process."""
        return f"{self.process.pid}:{self.socket_path}"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Return once the server accepts requests; ForkEngineError if it ended or took long."""
        if not self.ready.wait(timeout):
            raise ForkEngineError(f"the fork server was not ready after {timeout:g} s")
        if self.process.poll() is not None:
            raise ForkEngineError(
                f"the fork server ended (exit status {self.process.returncode}) before it forked"
            )

    def stop(self) -> None:
        """SIGTERM the server (it stops its workers), SIGKILL it after a grace."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            self.socket_path.unlink(missing_ok=True)
            self.directory.rmdir()


class SharedForkServer:
    """A fork server this backend did not start (``SERVER_VAR``): used, never stopped."""

    def __init__(self, pid: int, socket_path: Path) -> None:
        self.pid = pid
        self.socket_path = socket_path

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> SharedForkServer | None:
        """The server ``SERVER_VAR`` names, if it is running; else None."""

        pid, _, path = env.get(SERVER_VAR, "").partition(":")
        if not pid.isdigit() or not path or not pid_alive(int(pid)):
            return None
        return cls(int(pid), Path(path))

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Return once the socket exists; ForkEngineError if the server ended first."""

        deadline = time.monotonic() + timeout
        while not self.socket_path.exists():
            if not pid_alive(self.pid):
                raise ForkEngineError(f"the launcher's fork server (pid {self.pid}) ended")
            if time.monotonic() > deadline:
                raise ForkEngineError(
                    f"the launcher's fork server was not ready after {timeout:g} s"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Nothing: the launcher stops its server."""


def launch_server(
    env: Mapping[str, str], num_cpus: float, gpu_fraction: float
) -> ForkServerProcess | None:
    """A fork server for a launch whose simulation will run on forked workers (``eligible``),
    started now with the libraries only; None where the run will use Ray."""
    config = {"client_resources": {"num_cpus": num_cpus, "num_gpus": gpu_fraction}}
    if not eligible(config, env):
        return None
    return ForkServerProcess(env, (*LIBRARIES, WORKER_MODULE))


class Worker:
    """One forked worker: its channel and its process (``ForkedProcess`` or ``Popen``)."""

    def __init__(self, channel: socket.socket, process: Any) -> None:
        self.channel = channel
        self.process = process

    def exit_status(self) -> int | None:
        """The worker's exit status once it ended (waiting briefly for it), else None."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            status = self.process.poll()
            if status is not None:
                return status
            time.sleep(0.02)
        return None

    def close(self) -> None:
        """Close the channel (the worker ends when it reads the end) and the fork server's
        connection for it (the server then SIGKILLs it if it is still there)."""
        with contextlib.suppress(OSError):
            self.channel.close()
        connection = getattr(self.process, "connection", None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.close()


class ForkBackend:
    """Flower's ``Backend`` interface over workers forked from one fork server."""

    def __init__(
        self, backend_config: Mapping[str, Any], preload: tuple[str, ...] = PRELOAD
    ) -> None:
        self.backend_config = dict(backend_config)
        self.resources = client_resources(self.backend_config)
        self.size = slots(self.backend_config)
        self.env = worker_environment(self.resources["num_cpus"])
        self.server: ForkServerProcess | SharedForkServer = SharedForkServer.from_environment(
            self.env
        ) or ForkServerProcess(self.env, preload)
        self.origin = (
            "started by the launcher"
            if isinstance(self.server, SharedForkServer)
            else "started by the simulation"
        )
        self.idle: queue.Queue[Worker | None] = queue.Queue()
        self.app: tuple[str, str] | None = None
        self.lock = threading.Lock()
        self.workers: set[Worker] = set()

    @property
    def num_workers(self) -> int:
        """How many messages run at once."""
        return self.size

    def build(self, app_fn: Callable[[], Any]) -> None:
        """Resolve the ClientApp's name; the workers are forked on their first message."""
        self.app = app_reference(app_fn())
        for _ in range(self.size):
            self.idle.put(None)  # a slot without a worker yet
        log.debug("fork engine: %d slots for %s:%s", self.size, *self.app)

    def is_worker_idle(self) -> bool:
        """Whether a slot is free."""
        return not self.idle.empty()

    def _start_worker(self) -> Worker:
        from flwr.clientapp.client_app import LoadClientAppError

        from fedfm_flower.deploy.forkserver import request_fork  # runs as a program

        self.server.wait_ready()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                process: Any = request_fork(
                    self.server.socket_path, [], env=self.env, stdio=(theirs.fileno(), 1, 2)
                )
            except OSError as err:
                raise ForkEngineError(f"the fork server did not fork a worker: {err}") from err
        finally:
            theirs.close()
        worker = Worker(ours, process)
        assert self.app is not None
        try:
            send_frame(ours, ("app", *self.app, list(sys.path)))
            answer = receive_frame(ours)
        except (ChannelClosed, OSError) as err:
            status = worker.exit_status()  # before close: it reads the server's connection
            worker.close()
            raise ForkEngineError(
                f"a new worker ended before it loaded the ClientApp ({err}; exit status {status})"
            ) from err
        if answer[0] != "ready":
            worker.close()
            raise LoadClientAppError(answer[1])
        with self.lock:
            self.workers.add(worker)
        return worker

    def process_message(self, message: Any, context: Any) -> tuple[Any, Any]:
        """Run the ClientApp on ``message`` in a free worker; its reply and updated context."""
        from flwr.clientapp.client_app import ClientAppException

        worker = self.idle.get()
        try:
            if worker is None:
                worker = self._start_worker()
            try:
                send_frame(worker.channel, ("run", message, context))
                answer = receive_frame(worker.channel)
            except (ChannelClosed, OSError) as err:
                status = worker.exit_status()
                self._forget(worker)
                worker = None  # the slot forks a new worker for its next message
                how = f"exit status {status}" if status is not None else f"its channel: {err}"
                raise ClientAppException(
                    f"the worker running this ClientApp ended ({how}); the next message forks "
                    "a new one"
                ) from err
        except BaseException:
            self.idle.put(worker)
            raise
        self.idle.put(worker)
        if answer[0] == "ok":
            return answer[1], answer[2]
        raise ClientAppException(answer[1])

    def _forget(self, worker: Worker) -> None:
        worker.close()
        with self.lock:
            self.workers.discard(worker)

    def terminate(self) -> None:
        """Close every worker's channel and stop the fork server (and with it the workers)."""
        with self.lock:
            workers, self.workers = list(self.workers), set()
        for worker in workers:
            worker.close()
        self.server.stop()


def backend_config_of(backend_fn: Callable[[], Any]) -> dict[str, Any] | None:
    """The backend config ``start_vce``'s ``backend_fn`` closes over, or None."""
    config = inspect.getclosurevars(backend_fn).nonlocals.get("backend_config")
    return config if isinstance(config, dict) else None


def with_fork_backend(run_api: Callable[..., Any]) -> Callable[..., Any]:
    """Flower's ``run_api`` given a ``ForkBackend`` instead of its ``backend_fn``'s
    ``RayBackend`` where ``eligible``; Flower's ``RayBackend`` itself is left as it is."""

    def run_api_forked(
        app_fn: Callable[[], Any], backend_fn: Callable[[], Any], *args: Any, **kwargs: Any
    ) -> Any:
        config = backend_config_of(backend_fn)
        if config is None or not eligible(config):
            return run_api(app_fn, backend_fn, *args, **kwargs)

        def fork_backend_fn() -> ForkBackend:
            backend = ForkBackend(config)
            print(
                f"fedfm_flower.simulation.fork_engine: {backend.size} ClientApps at once, "
                f"in workers forked from one process ({backend.origin}; "
                "FEDFM_SIMULATION_ENGINE=ray "
                "runs Ray's actors)",
                file=sys.stderr,
                flush=True,
            )
            return backend

        return run_api(app_fn, fork_backend_fn, *args, **kwargs)

    run_api_forked.__wrapped__ = run_api  # type: ignore[attr-defined]
    return run_api_forked


def install() -> bool:
    """Let the simulation engine's run use a ``ForkBackend`` where eligible (in the simulation
    process, over the ``start_vce`` and ``run_api`` this module knows); True when in place
    (now or before)."""
    engine = sys.modules.get(ENGINE_MODULE)
    if engine is None or os.environ.get(ENV_SWITCH) == "ray":
        return False
    if getattr(engine.run_api, "__wrapped__", None) is not None:
        return True

    functions = {name: getattr(engine, name, None) for name in FLOWER_SOURCES}
    unknown = unknown_sources(functions, FLOWER_SOURCES)
    if unknown:
        print(
            f"fedfm_flower.simulation.fork_engine: Flower's {', '.join(unknown)} is not the "
            "code this project knows; the simulation runs on Ray",
            file=sys.stderr,
        )
        return False
    engine.run_api = with_fork_backend(engine.run_api)
    return True
