"""Deploy the Flower App on this machine over loopback: one SuperLink, N SuperNodes, one run.

Run with the project's virtualenv:

    .venv/bin/python scripts/deploy_local.py --num-supernodes 2 \\
        --run-config "method='fedavg' num-server-rounds=3"

Step by step (docs/deployment.md explains each one):

1. TLS certificates (CA + SuperLink certificate for 127.0.0.1/localhost) from
   ``scripts/generate_certs.sh`` and one ECDSA P-384 key pair per SuperNode, created in the work
   directory when missing (secure mode, the default; ``--insecure`` skips both).
2. A ``flwr`` connection ``[superlink.fedfm-local]`` in ``<workdir>/flwr-home/config.toml``
   (address, root certificate or ``insecure = true``); ``FLWR_HOME`` points there for every
   process started here.
3. ``flower-superlink`` on 127.0.0.1:<base-port> (Fleet, Control and Runtime APIs share it) with
   TLS, ``--enable-supernode-auth`` and a fresh ``--database`` in the work directory.
4. Each SuperNode's public key is registered with ``flwr supernode register``.
5. ``flower-supernode`` i = 0..N-1 with ``--superlink 127.0.0.1:<base-port>``,
   ``--root-certificates``, ``--auth-supernode-private-key``, its own runtime ``--port``
   (base-port + 1 + i) and ``--node-config "client-id=i partition-id=i num-partitions=N
   state-dir=<workdir>/node_i"``; the script waits until all N are online.
6. ``flwr run <app> fedfm-local --stream --run-config <workdir>/run-config.toml`` (the merged
   overrides, always with ``num-clients=N``), then ``flwr ls --run-id`` for the final status.
7. Every process started here is stopped by process group (SIGTERM, then SIGKILL), and every
   process that carries this deployment's tag in its environment (SuperExec, ServerApp and
   ClientApp subprocesses, which Flower starts in new sessions) is found and stopped too; this
   runs on success, on error, on Ctrl-C and on SIGTERM/SIGHUP.

Every process gets ``OMP_NUM_THREADS`` = usable CPUs / (N + 1) (``--threads``), since N + 1
torch processes share the cores. Logs (with wall-clock and elapsed-time stamps) go to
``<workdir>/logs/``. Only 127.0.0.1 is ever used.

Before anything starts, the merged run config is validated and checked
(``fedfm_flower.preflight``: resume target, existing results, weights file, partition sizes);
a problem is one line on stderr. The run's stream is shown with tracebacks folded (``--debug``
shows them; the logs keep them). Exit status (``fedfm_flower.launch.ExitCode``): 0 run
completed, 1 run failed or stopped, 2 bad arguments or run config, 3 the deployment could not
start, 124 ``--run-timeout`` reached, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from fedfm_flower.launch import (
    COMPLETED_STATUS,
    ExitCode,
    exit_code_for_status,
    final_run_status,
    run_id_from_lines,
)
from fedfm_flower.preflight import (
    PreflightError,
    absolute_paths,
    check_run,
    parse_item,
    resolve_config,
)
from fedfm_flower.processes import (
    flower_environment,
    pid_alive,
    pids_with_environment,
    signal_process,
)
from fedfm_flower.tracebacks import StreamFilter

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"  # the only address this script ever binds to or dials
DEFAULT_BASE_PORT = 19190
CONNECTION = "fedfm-local"
TAG_VAR = "FEDFM_DEPLOY_ID"  # environment variable marking every process of one deployment
NODE_VAR = "FEDFM_DEPLOY_NODE"  # ... and the processes of one SuperNode (its index)
CERT_FILES = ("ca.crt", "server.crt", "server.key")


class DeploymentError(RuntimeError):
    """A failure with a message meant for the user (what happened, where to look)."""


class RunConfigError(ValueError):
    """An invalid --run-config value."""


@dataclasses.dataclass
class DeployOptions:
    """Everything that shapes one local deployment."""

    num_supernodes: int = 2
    workdir: Path = ROOT / "deploy" / "work"
    app_dir: Path = ROOT
    base_port: int | None = None  # None: DEFAULT_BASE_PORT, or the next free block if busy
    insecure: bool = False
    certs_dir: Path | None = None  # None: <workdir>/certs, generated when missing
    keys_dir: Path | None = None  # None: <workdir>/keys, generated when missing
    startup_timeout: float = 60.0  # seconds for the SuperLink, then for all SuperNodes
    run_timeout: float | None = None  # seconds for `flwr run`; None: no limit
    threads: int | None = None  # OpenMP/torch threads per ServerApp/ClientApp; None: see below
    echo: bool = True  # print `flwr run`'s stream
    debug: bool = False  # print it unfolded (tracebacks in full)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).expanduser().resolve()
        self.app_dir = Path(self.app_dir).expanduser().resolve()
        if self.num_supernodes <= 0:
            raise ValueError(f"--num-supernodes must be > 0, got {self.num_supernodes}")
        if (
            self.base_port is not None
            and not 1024 <= self.base_port <= 65535 - 1 - self.num_supernodes
        ):
            raise ValueError(f"--base-port must leave room for {self.num_supernodes + 1} ports")

    @property
    def certs(self) -> Path:
        """Directory with ca.crt, server.crt and server.key."""
        return (
            Path(self.certs_dir).expanduser().resolve()
            if self.certs_dir
            else self.workdir / "certs"
        )

    @property
    def keys(self) -> Path:
        """Directory with supernode_<i> / supernode_<i>.pub key pairs."""
        return (
            Path(self.keys_dir).expanduser().resolve() if self.keys_dir else self.workdir / "keys"
        )


@dataclasses.dataclass
class RunResult:
    """What one `flwr run` produced."""

    run_id: int | None
    status: str  # e.g. "finished:completed", "finished:failed", "not-started", "timeout"
    returncode: int | None
    seconds: float
    run_dir: Path | None
    log_path: Path
    details: str = ""  # Flower's status details (the ServerApp's error, when it failed)

    @property
    def ok(self) -> bool:
        """True when Flower reports the run as completed."""
        return self.status == COMPLETED_STATUS

    @property
    def exit_code(self) -> ExitCode:
        """The launcher's exit status for this outcome."""
        if self.status == "timeout":
            return ExitCode.TIMEOUT
        if self.status == "not-started":
            return ExitCode.NOT_STARTED
        return exit_code_for_status(self.status)


# ----------------------------------------------------------------------------------------------
# Run config


def parse_run_config(items: Sequence[str] | None) -> dict[str, Any]:
    """Merge --run-config items (TOML files or "k=v ..." strings, in order) into one dict.

    Uses Flower's own parser for each item, so values follow `flwr run`'s rules (strings need
    quotes: ``method='fedavg'``).
    """
    merged: dict[str, Any] = {}
    for item in items or []:
        if item.strip():
            try:
                merged.update(parse_item(item, Path.cwd()))
            except PreflightError as err:
                raise RunConfigError(str(err)) from err
    return merged


def resolve_run_config(
    overrides: Mapping[str, Any], num_clients: int, app_dir: Path, base: Path | None = None
) -> dict[str, Any]:
    """Overrides plus ``num-clients``, absolute paths and a default ``output-dir``.

    Paths are made absolute against ``base`` (the caller's directory), since the ServerApp and
    ClientApps run with the SuperLink's and SuperNodes' working directories. Keys must exist
    under ``[tool.flwr.app.config]`` of the app (Flower rejects others) and values must pass
    ``ExperimentConfig`` validation; both are checked here, before anything starts.
    """
    config = dict(overrides)
    given = config.get("num-clients")
    if given not in (None, 0, num_clients):
        raise RunConfigError(
            f"run config num-clients={given} differs from --num-supernodes {num_clients}"
        )
    config["num-clients"] = num_clients
    config.setdefault("output-dir", str(app_dir / "runs"))
    config = absolute_paths(config, base or Path.cwd())
    try:  # every value, not just the keys: fail here rather than in the ServerApp
        resolve_config(app_dir, config)
    except PreflightError as err:
        raise RunConfigError(str(err)) from err
    return config


def write_toml(path: Path, data: Mapping[str, Any]) -> Path:
    """Write a flat or nested mapping as TOML."""
    import tomli_w

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(dict(data)))
    return path


# ----------------------------------------------------------------------------------------------
# Ports, certificates, keys


def port_is_free(port: int) -> bool:
    """Whether 127.0.0.1:port can be bound right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the servers do: connections in TIME_WAIT from an earlier run don't block the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def choose_base_port(requested: int | None, count: int) -> int:
    """A base port with ``count`` free consecutive ports on 127.0.0.1.

    An explicit request must be free; the default moves up in blocks of 100 when busy.
    """
    if requested is not None:
        busy = [p for p in range(requested, requested + count) if not port_is_free(p)]
        if busy:
            raise DeploymentError(
                f"port(s) {busy} on {HOST} are in use; pick another --base-port "
                f"(this deployment needs {count} consecutive ports)"
            )
        return requested
    for base in range(DEFAULT_BASE_PORT, 60000, 100):
        if all(port_is_free(p) for p in range(base, base + count)):
            return base
    raise DeploymentError(f"no {count} consecutive free ports found on {HOST}")


def ensure_certificates(options: DeployOptions) -> Path:
    """The certificate directory; generated when it is the default one and incomplete."""
    certs = options.certs
    missing = [name for name in CERT_FILES if not (certs / name).is_file()]
    if missing and options.certs_dir is None:
        script = ROOT / "scripts" / "generate_certs.sh"
        result = subprocess.run(
            ["bash", str(script), str(certs)], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise DeploymentError(
                f"{script} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
        missing = [name for name in CERT_FILES if not (certs / name).is_file()]
    if missing:
        raise DeploymentError(
            f"missing TLS file(s) {', '.join(str(certs / m) for m in missing)}; create them "
            f"with `scripts/generate_certs.sh {certs}` or pass --insecure (local debugging only)"
        )
    return certs


def generate_supernode_key(private_path: Path) -> None:
    """An ECDSA P-384 key pair in OpenSSH format (what `ssh-keygen -t ecdsa -b 384` writes)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    private_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private)
    private_path.with_suffix(".pub").write_bytes(public + f" {private_path.name}\n".encode())


def ensure_supernode_keys(options: DeployOptions) -> list[Path]:
    """Private key paths supernode_0..N-1 (public keys beside them, ``.pub``)."""
    keys = options.keys
    paths = [keys / f"supernode_{i}" for i in range(options.num_supernodes)]
    for path in paths:
        complete = path.is_file() and path.with_suffix(".pub").is_file()
        if not complete and options.keys_dir is None:
            generate_supernode_key(path)
        elif not complete:
            raise DeploymentError(
                f"missing SuperNode key {path} (or {path.name}.pub); create it with "
                f"`ssh-keygen -t ecdsa -b 384 -N '' -f {path}` or "
                f"`scripts/generate_certs.sh --supernode-keys {options.num_supernodes}`"
            )
    return paths


def write_flwr_config(flwr_home: Path, address: str, ca_cert: Path | None) -> Path:
    """``$FLWR_HOME/config.toml`` with one SuperLink connection, the default."""
    connection: dict[str, Any] = {"address": address}
    if ca_cert is None:
        connection["insecure"] = True
    else:
        connection["root-certificates"] = str(ca_cert)
    return write_toml(
        flwr_home / "config.toml",
        {"superlink": {"default": CONNECTION, CONNECTION: connection}},
    )


# ----------------------------------------------------------------------------------------------
# Processes


def _tagged_pids(tag: str, node: int | None = None, command: str | None = None) -> set[int]:
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
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


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
        self._log.write(f"# {_stamp(t0)} $ {shlex.join(self.command)}\n")
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
            self._log.write(f"{_stamp(t0)} {line}\n")
            self._log.flush()
            if echo is not None:
                echo(line)
        self._log.write(f"# {_stamp(t0)} exited with {self.popen.wait()}\n")
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


def _stamp(t0: float) -> str:
    now = _dt.datetime.now().strftime("%H:%M:%S.%f")[:-3]
    return f"{now} +{time.monotonic() - t0:8.3f}s"


# ----------------------------------------------------------------------------------------------
# The deployment


class LocalDeployment:
    """One SuperLink and N SuperNodes on 127.0.0.1; a context manager that always cleans up.

    >>> with LocalDeployment(DeployOptions(num_supernodes=2)) as deployment:
    ...     deployment.start()
    ...     result = deployment.run({"method": "fedavg", "num-server-rounds": 2})
    """

    def __init__(self, options: DeployOptions) -> None:
        self.options = options
        self.tag = uuid.uuid4().hex
        self.t0 = time.monotonic()
        self.processes: list[ManagedProcess] = []
        self.seen_pids: set[int] = set()  # every pid known to belong to this deployment
        self.timings: dict[str, float] = {}
        self.base_port: int | None = None
        self.superlink: ManagedProcess | None = None
        self.nodes: dict[int, ManagedProcess] = {}  # the current process of SuperNode i
        self.node_ids: dict[int, str] = {}
        self.keys: list[Path] = []
        self._runs = 0
        workdir = options.workdir
        self.flwr_home = workdir / "flwr-home"
        self.logs = workdir / "logs"
        self._stopped = False
        self._shown = StreamFilter(lambda text: print(text, flush=True), options.debug)

    # -- context manager ----------------------------------------------------------------------
    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers ------------------------------------------------------------------------------
    @property
    def supernodes(self) -> list[ManagedProcess]:
        """The current SuperNode processes, by index."""
        return [self.nodes[i] for i in sorted(self.nodes)]

    @property
    def address(self) -> str:
        """The SuperLink address (Fleet, Control and Runtime APIs)."""
        if self.base_port is None:
            raise DeploymentError("the deployment has not been started")
        return f"{HOST}:{self.base_port}"

    def env(self) -> dict[str, str]:
        """Environment of every process started here (tagged, offline, no `uv sync`)."""
        env = flower_environment(self.flwr_home)
        env.update({TAG_VAR: self.tag, "PYTHONUNBUFFERED": "1"})
        # The ServerApp and the N ClientApps share the CPU cores: without a limit each torch
        # process starts one OpenMP thread per core, and oversubscribed OpenMP spins (measured
        # here: foundation pretraining 12 s with 1 thread, 247 s with 2 threads on a busy 2-core
        # machine).
        threads = str(self.threads())
        env.setdefault("OMP_NUM_THREADS", threads)
        env.setdefault("MKL_NUM_THREADS", threads)
        return env

    def threads(self) -> int:
        """OpenMP/torch threads per ServerApp/ClientApp process: usable CPUs / (N + 1)."""
        if self.options.threads:
            return self.options.threads
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        return max(1, cpus // (self.options.num_supernodes + 1))

    def _bin(self, name: str) -> str:
        path = Path(sys.executable).parent / name
        if not path.exists():
            found = shutil.which(name)
            if found is None:
                raise DeploymentError(f"`{name}` not found next to {sys.executable} or on PATH")
            return found
        return str(path)

    def _say(self, message: str) -> None:
        print(f"[deploy +{time.monotonic() - self.t0:6.1f}s] {message}", flush=True)

    def _start(
        self,
        name: str,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        echo: Callable[[str], None] | None = None,
        cwd: Path | None = None,
    ) -> ManagedProcess:
        process = ManagedProcess(
            name,
            command,
            self.logs / f"{name}.log",
            env or self.env(),
            cwd or self.options.workdir,
            self.t0,
            echo,
        )
        self.processes.append(process)
        self.seen_pids.add(process.pid)
        return process

    def flwr(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a short `flwr` CLI command against this deployment's FLWR_HOME."""
        command = [self._bin("flwr"), *args]
        try:
            return subprocess.run(
                command,
                env=self.env(),
                cwd=str(self.options.workdir),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as err:
            raise DeploymentError(f"`{shlex.join(command)}` did not finish in {timeout}s") from err

    # -- start --------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Work directory, ports, certificates, keys and the flwr connection."""
        options = self.options
        options.workdir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.base_port = choose_base_port(options.base_port, options.num_supernodes + 1)
        ca_cert = None
        if not options.insecure:
            ca_cert = ensure_certificates(options) / "ca.crt"
            self.keys = ensure_supernode_keys(options)
        write_flwr_config(self.flwr_home, self.address, ca_cert)

    def start(self) -> None:
        """Start the SuperLink, register the keys, start the SuperNodes, wait for them."""
        self.prepare()
        self.start_superlink()
        for i in range(self.options.num_supernodes):
            if not self.options.insecure:
                self.node_ids[i] = self.register_key(self.keys[i].with_suffix(".pub"))
        started = time.monotonic()
        for i in range(self.options.num_supernodes):
            self.start_supernode(i)
        self.wait_for_supernodes(self.options.num_supernodes)
        self.timings["supernodes-online-s"] = time.monotonic() - started
        self._say(
            f"{self.options.num_supernodes} SuperNode(s) online after "
            f"{self.timings['supernodes-online-s']:.1f}s"
        )

    def start_superlink(self) -> ManagedProcess:
        """`flower-superlink` on 127.0.0.1:<base-port>, waiting until it accepts TLS/TCP."""
        options = self.options
        state = options.workdir / "superlink"
        state.mkdir(parents=True, exist_ok=True)
        database = state / "state.db"
        for stale in state.glob("state.db*"):
            stale.unlink()  # a fresh federation each time: registrations, runs
        command = [
            self._bin("flower-superlink"),
            "--host",
            HOST,
            "--port",
            str(self.base_port),
            "--isolation",
            "subprocess",
            "--database",
            str(database),
        ]
        if options.insecure:
            command.append("--insecure")
        else:
            certs = options.certs
            command += [
                "--ssl-ca-certfile",
                str(certs / "ca.crt"),
                "--ssl-certfile",
                str(certs / "server.crt"),
                "--ssl-keyfile",
                str(certs / "server.key"),
                "--enable-supernode-auth",
            ]
        started = time.monotonic()
        mode = "insecure" if options.insecure else "TLS + SuperNode auth"
        self._say(f"starting SuperLink on {self.address} ({mode})")
        self.superlink = self._start("superlink", command)
        self.wait_for_superlink(options.startup_timeout)
        self.timings["superlink-start-s"] = time.monotonic() - started
        self._say(f"SuperLink ready after {self.timings['superlink-start-s']:.1f}s")
        return self.superlink

    def wait_for_superlink(self, timeout: float) -> None:
        """Until the SuperLink completes a TLS handshake (or TCP connect when insecure)."""
        assert self.superlink is not None and self.base_port is not None
        deadline = time.monotonic() + timeout
        context = None
        if not self.options.insecure:
            context = ssl.create_default_context(cafile=str(self.options.certs / "ca.crt"))
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if not self.superlink.alive():
                self.superlink.join_output()
                raise DeploymentError(
                    f"SuperLink exited with {self.superlink.popen.returncode} during start; "
                    f"log {self.superlink.log_path}:\n{self.superlink.tail()}"
                )
            try:
                with socket.create_connection((HOST, self.base_port), timeout=2.0) as sock:
                    if context is not None:
                        with context.wrap_socket(sock, server_hostname=HOST):
                            pass
                return
            except ssl.SSLCertVerificationError as err:
                raise DeploymentError(
                    f"the SuperLink's certificate does not verify against "
                    f"{self.options.certs / 'ca.crt'}: {err.verify_message}; regenerate the "
                    "certificates with scripts/generate_certs.sh --force"
                ) from err
            except OSError as err:
                last_error = err
                time.sleep(0.2)
        raise DeploymentError(
            f"SuperLink not reachable at {self.address} within {timeout:.0f}s "
            f"(last error: {last_error}); log {self.superlink.log_path}:\n{self.superlink.tail()}"
        )

    def register_key(self, public_key: Path) -> str:
        """`flwr supernode register <key>.pub fedfm-local`; returns the node id."""
        result = self.flwr("supernode", "register", str(public_key), CONNECTION, "--format", "json")
        try:
            payload = json.loads(result.stdout)
        except json.JSONDecodeError:
            payload = {}
        if result.returncode == 0 and payload.get("success"):
            node_id = str(payload.get("node-id"))
            self._say(f"registered {public_key.name} as node {node_id}")
            return node_id
        raise DeploymentError(
            f"`flwr supernode register {public_key}` failed ({result.returncode}): "
            f"{(result.stdout + result.stderr).strip()}"
        )

    def start_supernode(
        self,
        index: int,
        private_key: Path | None = None,
        node_config: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> ManagedProcess:
        """`flower-supernode` number ``index`` with its own runtime port and node config."""
        options = self.options
        n = options.num_supernodes
        state_dir = options.workdir / f"node_{index}"
        state_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "client-id": index,
            "partition-id": index,
            "num-partitions": n,
            "state-dir": str(state_dir),
        }
        for key, value in (node_config or {}).items():  # None removes a key
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        port = self.base_port + 1 + index if self.base_port is not None else None
        if port is None or not port_is_free(port):
            port = _free_port()
        command = [
            self._bin("flower-supernode"),
            "--superlink",
            self.address,
            "--host",
            HOST,
            "--port",
            str(port),
            "--node-config",
            _node_config_string(config),
        ]
        if options.insecure:
            command.append("--insecure")
        else:
            key = private_key or self.keys[index]
            if not key.is_file():
                raise DeploymentError(f"missing SuperNode private key {key}")
            command += [
                "--root-certificates",
                str(options.certs / "ca.crt"),
                "--auth-supernode-private-key",
                str(key),
            ]
        env = {**self.env(), NODE_VAR: str(index)}
        process = self._start(name or f"supernode_{index}", command, env=env)
        self.nodes[index] = process
        return process

    def kill_supernode(self, index: int, timeout: float = 10.0) -> list[int]:
        """SIGKILL SuperNode ``index`` and its ClientApp processes at once (a machine crash).

        Returns the pids killed. Nothing gets to clean up: no deregistration, no final write.
        """
        pids = sorted(_tagged_pids(self.tag, node=index))
        for pid in pids:
            signal_process(pid, signal.SIGKILL, group=False)
        process = self.nodes.get(index)
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(timeout=timeout)
            process.join_output()
        deadline = time.monotonic() + timeout
        while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
            _reap_orphans_if_safe(self.processes)
            time.sleep(0.05)
        self._say(f"killed SuperNode {index} (pids {pids})")
        return pids

    def restart_supernode(self, index: int, timeout: float = 150.0) -> ManagedProcess:
        """Start SuperNode ``index`` again after a crash, with the same key and state-dir.

        With SuperNode authentication the SuperLink refuses to activate a node id it still
        believes online (`Failed to activate SuperNode`, exit 305), which lasts until two missed
        heartbeats (Flower's 2 x 30 s) after the crash; this waits for that first.
        """
        node_id = self.node_ids.get(index)
        if node_id is not None:
            started = time.monotonic()
            while any(str(n.get("node-id")) == node_id for n in self.online_nodes()):
                if time.monotonic() - started > timeout:
                    raise DeploymentError(
                        f"node {node_id} (SuperNode {index}) still online {timeout:.0f}s after "
                        "it stopped; is another process using its key?"
                    )
                time.sleep(1.0)
            self._say(
                f"SuperLink marked node {node_id} offline after "
                f"{time.monotonic() - started:.0f}s; restarting SuperNode {index}"
            )
        return self.start_supernode(index)

    def clientapp_pids(self, index: int) -> set[int]:
        """Live ClientApp processes of SuperNode ``index`` (one per message in flight)."""
        return _tagged_pids(self.tag, node=index, command="flwr-clientapp")

    def serverapp_pids(self) -> set[int]:
        """Live ServerApp processes of this deployment."""
        return _tagged_pids(self.tag, command="flwr-serverapp")

    def kill_serverapp(self) -> list[int]:
        """SIGKILL the running ServerApp process(es) (a crash mid-run); returns the pids."""
        pids = sorted(self.serverapp_pids())
        for pid in pids:
            signal_process(pid, signal.SIGKILL, group=False)
        self._say(f"killed ServerApp (pids {pids})")
        return pids

    def online_nodes(self) -> list[dict[str, Any]]:
        """`flwr supernode list` entries with status "online"."""
        result = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        try:
            nodes = json.loads(result.stdout).get("nodes", [])
        except (json.JSONDecodeError, AttributeError):
            return []
        return [node for node in nodes if node.get("status") == "online"]

    def wait_for_supernodes(self, count: int, timeout: float | None = None) -> None:
        """Until ``count`` SuperNodes are online; fails early if one exits."""
        timeout = timeout or self.options.startup_timeout
        deadline = time.monotonic() + timeout
        online: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            for process in self.supernodes:
                if not process.alive():
                    process.join_output()
                    raise DeploymentError(
                        f"{process.name} exited with {process.popen.returncode}; "
                        f"log {process.log_path}:\n{process.tail()}"
                    )
            online = self.online_nodes()
            if len(online) >= count:
                return
            time.sleep(0.5)
        raise DeploymentError(
            f"only {len(online)} of {count} SuperNodes came online within {timeout:.0f}s; "
            f"see the logs in {self.logs}"
        )

    # -- run ----------------------------------------------------------------------------------
    def run(
        self,
        run_config: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> RunResult:
        """`flwr run <app> fedfm-local --stream` with the merged run config; waits for the end."""
        return self.finish_run(self.start_run(run_config), timeout)

    def start_run(self, run_config: Mapping[str, Any] | None = None) -> ManagedProcess:
        """Start `flwr run <app> fedfm-local --stream` without waiting (see ``finish_run``)."""
        options = self.options
        config = resolve_run_config(run_config or {}, options.num_supernodes, options.app_dir)
        config_file = write_toml(options.workdir / "run-config.toml", config)
        command = [
            self._bin("flwr"),
            "run",
            str(options.app_dir),
            CONNECTION,
            "--stream",
            "--run-config",
            str(config_file),
        ]
        self._say(f"$ {shlex.join(command)}")
        self._say(f"run config: {json.dumps(config)}")
        self._runs += 1
        return self._start(
            "flwr_run" if self._runs == 1 else f"flwr_run_{self._runs}",
            command,
            echo=self._echo if options.echo else None,
            cwd=options.app_dir,
        )

    def finish_run(self, process: ManagedProcess, timeout: float | None = None) -> RunResult:
        """Wait for a `flwr run` from ``start_run`` (stopping the run after ``timeout``)."""
        started = process.started
        timeout = timeout if timeout is not None else self.options.run_timeout
        status = None
        try:
            process.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = "timeout"
            self._say(f"`flwr run` still running after {timeout:.0f}s: stopping the run")
        process.join_output()
        self._shown.close()
        run_id = run_id_from_lines(process.lines)
        details = ""
        if status == "timeout":
            if run_id is not None:
                self.flwr("stop", str(run_id), CONNECTION, timeout=30)
        elif run_id is None:
            status = "not-started"
        else:
            status, details = final_run_status(
                self._bin("flwr"), CONNECTION, run_id, self.env(), cwd=str(self.options.workdir)
            )
        seconds = time.monotonic() - started
        run_dir = _run_dir(process.lines)
        result = RunResult(
            run_id, status, process.popen.returncode, seconds, run_dir, process.log_path, details
        )
        self.timings["run-s"] = seconds
        self._say(f"run {run_id}: {status} after {seconds:.1f}s; results in {run_dir}")
        return result

    def _echo(self, line: str) -> None:
        self._shown.feed(line)

    # -- stop ---------------------------------------------------------------------------------
    def live_pids(self) -> set[int]:
        """Every live process of this deployment (started here, or tagged descendants)."""
        pids = {p.pid for p in self.processes if p.alive()} | _tagged_pids(self.tag)
        self.seen_pids |= pids
        return {pid for pid in pids if pid_alive(pid)}

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every process group and tagged process, SIGKILL what remains after ``grace``."""
        with _shield_signals():
            self._stop(grace)

    def _stop(self, grace: float) -> None:
        if self._stopped and not self.live_pids():
            return
        self._stopped = True
        live = self.live_pids()
        if live:
            self._say(f"stopping {len(live)} process(es)")
        # The run's client first, then SuperNodes, then the SuperLink (reverse start order).
        for process in reversed(self.processes):
            if process.alive():
                signal_process(process.pid, signal.SIGTERM, group=True)
        for pid in live:
            signal_process(pid, signal.SIGTERM, group=False)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for process in self.processes:
                process.popen.poll()
            _reap_orphans_if_safe(self.processes)
            if not self.live_pids():
                break
            time.sleep(0.1)
        leftover = self.live_pids()
        for process in self.processes:
            if process.alive():
                signal_process(process.pid, signal.SIGKILL, group=True)
        for pid in leftover:
            signal_process(pid, signal.SIGKILL, group=False)
        if leftover:
            self._say(
                f"killed {len(leftover)} process(es) that ignored SIGTERM: {sorted(leftover)}"
            )
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(timeout=5)
            process.join_output()
        _reap_orphans_if_safe(self.processes)
        deadline = time.monotonic() + 5
        while self.live_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
            _reap_orphans_if_safe(self.processes)
        remaining = self.live_pids()
        if remaining:
            self._say(f"WARNING: processes still alive: {sorted(remaining)}")


def _reap_orphans_if_safe(processes: Sequence[ManagedProcess]) -> None:
    # waitpid(-1) must not steal the exit status of a Popen still being tracked.
    if _SUBREAPER and all(p.popen.returncode is not None for p in processes):
        _reap_orphans()


_SUBREAPER = False


@contextlib.contextmanager
def _shield_signals() -> Iterator[None]:
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _node_config_string(config: Mapping[str, Any]) -> str:
    """``key=value`` pairs for --node-config; strings quoted for TOML."""
    parts = []
    for key, value in config.items():
        if isinstance(value, str):
            if '"' in value or "\\" in value:
                raise DeploymentError(f"node config {key}={value!r}: no quotes or backslashes")
            parts.append(f'{key}="{value}"')
        elif isinstance(value, bool):
            parts.append(f"{key}={str(value).lower()}")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def _run_dir(lines: Sequence[str]) -> Path | None:
    for line in reversed(lines):
        match = re.search(r"results in (\S+)", line)
        if match:
            return Path(match.group(1).rstrip(";,"))
    return None


# ----------------------------------------------------------------------------------------------
# Command line


class _Terminated(Exception):
    """SIGTERM or SIGHUP arrived."""


def _raise_terminated(signum: int, _frame: object) -> None:
    raise _Terminated(signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="See docs/deployment.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--num-supernodes", type=int, default=2, help="SuperNodes (= clients)")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=ROOT / "deploy" / "work",
        help="state, logs, certificates, keys, FLWR_HOME (default: deploy/work)",
    )
    parser.add_argument(
        "--run-config",
        action="append",
        default=[],
        metavar="'k=v ...' | FILE.toml",
        help="run-config overrides; repeatable, merged in order (num-clients is set to N)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="no TLS and no SuperNode authentication (local debugging only)",
    )
    parser.add_argument(
        "--base-port",
        type=int,
        default=None,
        help=f"SuperLink port; SuperNode i uses base+1+i (default {DEFAULT_BASE_PORT}, "
        "or the next free block of 100)",
    )
    parser.add_argument("--certs-dir", type=Path, help="existing ca.crt, server.crt, server.key")
    parser.add_argument("--keys-dir", type=Path, help="existing supernode_<i>(.pub) key pairs")
    parser.add_argument("--app", type=Path, default=ROOT, help="the Flower App directory")
    parser.add_argument(
        "--startup-timeout", type=float, default=60.0, help="seconds for the SuperLink/SuperNodes"
    )
    parser.add_argument("--run-timeout", type=float, default=None, help="seconds for the run")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OpenMP/torch threads of the ServerApp and of each ClientApp "
        "(default: CPUs / (N + 1), at least 1; OMP_NUM_THREADS in the environment wins)",
    )
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="after the run, keep the SuperLink and SuperNodes until Ctrl-C",
    )
    parser.add_argument("--no-run", action="store_true", help="start the federation only")
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks (of the checks and of the run)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Start, run, stop; returns the exit status."""
    global _SUBREAPER
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = DeployOptions(
            num_supernodes=args.num_supernodes,
            workdir=args.workdir,
            app_dir=args.app,
            base_port=args.base_port,
            insecure=args.insecure,
            certs_dir=args.certs_dir,
            keys_dir=args.keys_dir,
            startup_timeout=args.startup_timeout,
            run_timeout=args.run_timeout,
            threads=args.threads,
            debug=args.debug,
        )
    except ValueError as err:
        parser.error(str(err))
    try:  # everything about the run that can be checked before a process starts
        overrides = parse_run_config(args.run_config)
        resolved = resolve_run_config(overrides, options.num_supernodes, options.app_dir)
        if not args.no_run:
            found = check_run(resolve_config(options.app_dir, resolved), options.num_supernodes)
            for note in found.notes:
                print(f"[check] {note}", flush=True)
    except (RunConfigError, PreflightError) as err:
        if args.debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    if args.insecure:
        print("WARNING: --insecure: no TLS, no SuperNode authentication; local debugging only")
    _SUBREAPER = become_subreaper()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGHUP, _raise_terminated)
    deployment = LocalDeployment(options)
    code = ExitCode.COMPLETED
    try:
        deployment.start()
        if not args.no_run:
            result = deployment.run(overrides)
            code = result.exit_code
            if result.ok and result.run_dir is not None:
                print(f"results: {result.run_dir}")
            elif not result.ok:
                print(
                    f"error: run {result.run_id} {result.status}: "
                    f"{result.details or 'no details'}; log {result.log_path}",
                    file=sys.stderr,
                    flush=True,
                )
        if args.keep_running or args.no_run:
            deployment._say(
                f"running: connection '{CONNECTION}' in FLWR_HOME={deployment.flwr_home} "
                f"(address {deployment.address}); Ctrl-C stops everything"
            )
            while all(p.alive() for p in [deployment.superlink, *deployment.supernodes] if p):
                time.sleep(1.0)
            deployment._say("a SuperLink/SuperNode process exited; stopping")
    except DeploymentError as err:
        print(f"error: {err}", file=sys.stderr)
        code = ExitCode.NOT_STARTED
    except (KeyboardInterrupt, _Terminated) as err:
        reason = "SIGINT" if isinstance(err, KeyboardInterrupt) else str(err)
        print(f"\ninterrupted ({reason}); stopping everything", file=sys.stderr)
        code = ExitCode.INTERRUPTED
    finally:
        deployment.stop()
        timings = ", ".join(f"{k} {v:.1f}" for k, v in deployment.timings.items())
        deployment._say(f"stopped; timings: {timings or 'none'}; logs in {deployment.logs}")
    return code


if __name__ == "__main__":
    sys.exit(main())
