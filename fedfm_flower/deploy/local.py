"""``LocalDeployment``: one SuperLink and N SuperNodes on 127.0.0.1, started, run and stopped.

``start`` prepares the work directory (ports, certificates, keys, the flwr connection), starts
``flower-superlink`` with TLS, ``--enable-supernode-auth`` and a fresh database, registers each
SuperNode's public key, starts the ``flower-supernode`` processes with their node configs and
waits until all are online. ``run`` submits one run (``fedfm_flower.deploy.runs``). ``stop``
ends every process of the deployment, started here or tagged (``fedfm_flower.deploy.processes``).
``kill_supernode``, ``restart_supernode`` and ``kill_serverapp`` break it on purpose, for the
fault tests.

Imports inside functions keep ``flwr.app``, ``flwr.clientapp``, ``flwr.serverapp`` and ``torch``
out of this module's start-up; they load ``fedfm_flower.deploy.forkserver`` and
``fedfm_flower.deploy.superexec`` only when used (run as a program, ``python -m``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fedfm_flower.deploy.certificates import ensure_certificates, ensure_supernode_keys
from fedfm_flower.deploy.connection import (
    PortBlock,
    free_port,
    port_is_free,
    reserve_ports,
    write_flwr_config,
)
from fedfm_flower.deploy.options import (
    CONNECTION,
    HOST,
    IN_MEMORY,
    DeploymentError,
    DeployOptions,
)
from fedfm_flower.deploy.processes import (
    NODE_VAR,
    TAG_VAR,
    ManagedProcess,
    reap_orphans_if_safe,
    shield_signals,
    tagged_pids,
)
from fedfm_flower.deploy.runs import (
    RunResult,
    resolve_run_config,
    run_dir_from_lines,
    write_toml,
)
from fedfm_flower.deploy.supernode import SUPEREXEC_POLL_VAR
from fedfm_flower.records.tracebacks import StreamFilter
from fedfm_flower.simulation.app_stage import stage_app
from fedfm_flower.simulation.processes import (
    flower_command,
    flower_environment,
    pid_alive,
    signal_process,
)
from fedfm_flower.simulation.verdict import final_run_status, run_id_from_lines

# Flower's commands a local deployment runs (each found by ``processes.flower_command``).
FLOWER_COMMANDS = ("flwr", "flower-superlink", "flower-supernode")
REGISTER_AT_ONCE = 4  # `flwr supernode register` commands run at the same time


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
        self.ports: PortBlock | None = None  # held from prepare() until stop()
        self.superlink: ManagedProcess | None = None
        self.nodes: dict[int, ManagedProcess] = {}  # the current process of SuperNode i
        self.node_ids: dict[int, str] = {}
        self.node_overrides: dict[int, dict[str, Any]] = {}  # start_supernode's, by index
        self.keys: list[Path] = []
        self._runs = 0
        self._stages: dict[str, Path] = {}  # each `flwr run`'s staged app, by process name
        workdir = options.workdir
        self.flwr_home = workdir / "flwr-home"
        self.logs = workdir / "logs"
        self._stopped = False
        self._private_dir: Path | None = None  # a 0700 directory for a socket /tmp must hold
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
        if self.options.poll_interval is not None:  # the SuperExecs poll for tasks too
            env.setdefault(SUPEREXEC_POLL_VAR, repr(self.options.poll_interval))
        if self.options.pull_patience is not None:  # read by the nodes' warm executors
            from fedfm_flower.deploy.superexec import PULL_PATIENCE_VAR

            env[PULL_PATIENCE_VAR] = repr(self.options.pull_patience)
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

    def say(self, message: str) -> None:
        """A progress line on stdout, stamped with the seconds since the deployment began."""
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
        command = [flower_command("flwr"), *args]
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
        if self.ports is None:
            self.ports = reserve_ports(options.base_port, options.num_supernodes + 1)
        self.base_port = self.ports.base
        ca_cert = None
        if not options.insecure:
            ca_cert = ensure_certificates(options) / "ca.crt"
            self.keys = ensure_supernode_keys(options)
        write_flwr_config(self.flwr_home, self.address, ca_cert)

    def start(self, node_overrides: Mapping[int, Mapping[str, Any]] | None = None) -> None:
        """Start the SuperLink, register the keys, start the SuperNodes (node ``i`` with
        ``node_overrides[i]`` in its node config), wait for them."""
        self.prepare()
        self.start_superlink()
        if not self.options.insecure:
            self.register_keys(range(self.options.num_supernodes))
        if self.options.shared_imports:
            self.start_forkserver()
        started = time.monotonic()
        for i in range(self.options.num_supernodes):
            self.start_supernode(i, node_config=(node_overrides or {}).get(i))
        self.wait_for_supernodes(self.options.num_supernodes)
        self.timings["supernodes-online-s"] = time.monotonic() - started
        self.say(
            f"{self.options.num_supernodes} SuperNode(s) online after "
            f"{self.timings['supernodes-online-s']:.1f}s"
        )

    def superlink_command(self) -> list[str]:
        """How the SuperLink starts: TLS and SuperNode authentication unless insecure, its
        state in a fresh SQLite file (or ``options.superlink_database``), through
        ``fedfm_flower.deploy.superlink`` unless ``options.superlink_lock_wait`` is None."""
        options = self.options
        database = options.superlink_database or str(options.workdir / "superlink" / "state.db")
        launcher = [flower_command("flower-superlink")]  # a missing Flower fails here
        if options.superlink_lock_wait is not None:
            launcher = [
                sys.executable,
                "-m",
                "fedfm_flower.deploy.superlink",
                "--lock-wait",
                repr(options.superlink_lock_wait),
            ]
        command = [
            *launcher,
            "--host",
            HOST,
            "--port",
            str(self.base_port),
            "--isolation",
            "subprocess",
            "--database",
            database,
        ]
        if options.insecure:
            return [*command, "--insecure"]
        certs = options.certs
        return [
            *command,
            "--ssl-ca-certfile",
            str(certs / "ca.crt"),
            "--ssl-certfile",
            str(certs / "server.crt"),
            "--ssl-keyfile",
            str(certs / "server.key"),
            "--enable-supernode-auth",
        ]

    def start_superlink(self, fresh: bool = True) -> ManagedProcess:
        """`flower-superlink` on 127.0.0.1:<base-port>, waiting until it accepts TLS/TCP;
        ``fresh``: a new state file in the work directory (else the one it left)."""
        options = self.options
        state = options.workdir / "superlink"
        state.mkdir(parents=True, exist_ok=True)
        for stale in state.glob("state.db*") if fresh else ():
            stale.unlink()  # a fresh federation each time: registrations, runs
        command = self.superlink_command()
        started = time.monotonic()
        mode = "insecure" if options.insecure else "TLS + SuperNode auth"
        self.say(f"starting SuperLink on {self.address} ({mode})")
        env = self.env()
        if options.poll_interval is not None and SUPEREXEC_POLL_VAR not in os.environ:
            # Its SuperExec starts one ServerApp per run: polling at the nodes' longest wait
            # costs a run's start at most that, and the SuperLink 7% of a core less while idle
            # (serving polls every 0.1 s: 190 CPU ticks per 20 s against 57 at 1 s).
            env[SUPEREXEC_POLL_VAR] = repr(options.max_poll_interval)
        self.superlink = self._start("superlink", command, env)
        self.wait_for_superlink(options.startup_timeout)
        self.timings["superlink-start-s"] = time.monotonic() - started
        self.say(f"SuperLink ready after {self.timings['superlink-start-s']:.1f}s")
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

    @property
    def forkserver_socket(self) -> Path:
        """Where the warm executors' fork server listens (with ``options.shared_imports``): in
        the work directory, or, where that path is too long for a Unix socket (108 bytes), in a
        directory of this user's alone under the temporary directory (a predictable name
        there could be bound first by another local user, who would then receive every
        SuperNode's environment and file descriptors)."""
        path = self.options.workdir / "forkserver.sock"
        if len(os.fsencode(path)) < 100:
            return path
        if self._private_dir is None:
            self._private_dir = Path(tempfile.mkdtemp(prefix="fedfm-forkserver-"))  # 0700
        return self._private_dir / "forkserver.sock"

    def start_forkserver(self) -> ManagedProcess:
        """The process that imports the warm executors' libraries once and forks one per
        SuperNode (``fedfm_flower.deploy.forkserver``), waiting until it listens."""
        socket_path = self.forkserver_socket
        socket_path.unlink(missing_ok=True)
        started = time.monotonic()
        command = [sys.executable, "-m", "fedfm_flower.deploy.forkserver", "--socket"]
        server = self._start("forkserver", [*command, str(socket_path)])
        deadline = started + self.options.startup_timeout
        while not socket_path.is_socket() or socket_path.stat().st_uid != os.getuid():
            if not server.alive():
                server.join_output()
                raise DeploymentError(
                    f"the fork server exited with {server.popen.returncode} during start; "
                    f"log {server.log_path}:\n{server.tail()}"
                )
            if time.monotonic() > deadline:
                raise DeploymentError(
                    f"the fork server did not listen on {socket_path} within "
                    f"{self.options.startup_timeout:.0f}s; log {server.log_path}"
                )
            time.sleep(0.2)
        self.timings["forkserver-start-s"] = time.monotonic() - started
        self.say(f"fork server ready after {self.timings['forkserver-start-s']:.1f}s")
        return server

    def register_key(self, public_key: Path) -> str:
        """`flwr supernode register <key>.pub fedfm-local`; returns the node id."""
        result = self.flwr("supernode", "register", str(public_key), CONNECTION, "--format", "json")
        try:
            payload = json.loads(result.stdout)
        except json.JSONDecodeError:
            payload = {}
        if result.returncode == 0 and payload.get("success"):
            node_id = str(payload.get("node-id"))
            self.say(f"registered {public_key.name} as node {node_id}")
            return node_id
        raise DeploymentError(
            f"`flwr supernode register {public_key}` failed ({result.returncode}): "
            f"{(result.stdout + result.stderr).strip()}"
        )

    def register_keys(self, indices: Iterable[int]) -> None:
        """Register SuperNode ``i``'s public key for each ``i`` in ``indices`` (``node_ids``), a
        few at a time: each `flwr supernode register` spends most of its time starting Python."""
        indices = list(indices)
        with ThreadPoolExecutor(max_workers=min(REGISTER_AT_ONCE, max(1, len(indices)))) as pool:
            found = pool.map(lambda i: self.register_key(self.keys[i].with_suffix(".pub")), indices)
            self.node_ids.update(zip(indices, found, strict=True))

    def start_supernode(
        self,
        index: int,
        private_key: Path | None = None,
        node_config: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> ManagedProcess:
        """`flower-supernode` number ``index`` with its own runtime port and node config
        (``node_config`` overrides, kept for ``restart_supernode``)."""
        options = self.options
        self.node_overrides[index] = dict(node_config or {})
        config = self.node_config(index, node_config)
        self.state_dir(index).mkdir(parents=True, exist_ok=True)
        port = self.base_port + 1 + index if self.base_port is not None else None
        if port is None or not port_is_free(port):
            port = free_port()
        command = [
            *self.supernode_command(),
            "--superlink",
            self.address,
            "--host",
            HOST,
            "--port",
            str(port),
            "--node-config",
            node_config_string(config),
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
        # Imported here: the package must not load the SuperExec module that `python -m` runs.
        from fedfm_flower.deploy.superexec import TASKS_DIR_VAR

        env = {**self.env(), NODE_VAR: str(index), TASKS_DIR_VAR: str(self.tasks_dir(index))}
        if self.options.shared_imports:
            from fedfm_flower.deploy.forkserver import FORKSERVER_VAR

            env[FORKSERVER_VAR] = str(self.forkserver_socket)
        process = self._start(name or f"supernode_{index}", command, env=env)
        self.nodes[index] = process
        return process

    def state_dir(self, index: int) -> Path:
        """SuperNode ``index``'s own directory: its clients' state, its task marks."""
        return self.options.workdir / f"node_{index}"

    def node_config(self, index: int, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """SuperNode ``index``'s node config: client and partition ``index`` of N, its state
        directory, then ``options.node_config`` and ``overrides`` (a value None removes a key).
        The same dicts give an in-process run of the same federation."""
        config: dict[str, Any] = {
            "client-id": index,
            "partition-id": index,
            "num-partitions": self.options.num_supernodes,
            "state-dir": str(self.state_dir(index)),
        }
        for key, value in {**self.options.node_config, **(overrides or {})}.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        return config

    def supernode_command(self) -> list[str]:
        """How a SuperNode starts: with short idle waits, or as plain `flower-supernode`."""
        interval = self.options.poll_interval
        if interval is None:
            return [flower_command("flower-supernode")]
        flower_command("flower-supernode")  # a missing Flower fails here, as without short waits
        return [
            sys.executable,
            "-m",
            "fedfm_flower.deploy.supernode",
            "--poll-interval",
            repr(interval),
            "--max-poll-interval",
            repr(self.options.max_poll_interval),
            *(["--warm-executor"] if self.options.warm_executor else []),
            *(
                ["--heartbeat-interval", repr(self.options.heartbeat_interval)]
                if self.options.heartbeat_interval is not None
                else []
            ),
        ]

    def kill_supernode(self, index: int, timeout: float = 10.0) -> list[int]:
        """SIGKILL SuperNode ``index`` and its ClientApp processes at once (a machine crash).

        Returns the pids killed. Nothing gets to clean up: no deregistration, no final write.
        """
        pids = sorted(tagged_pids(self.tag, node=index))
        for pid in pids:
            signal_process(pid, signal.SIGKILL, group=False)
        process = self.nodes.get(index)
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(timeout=timeout)
            process.join_output()
        deadline = time.monotonic() + timeout
        while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
            reap_orphans_if_safe(self.processes)
            time.sleep(0.05)
        self.say(f"killed SuperNode {index} (pids {pids})")
        return pids

    def restart_supernode(self, index: int, timeout: float = 150.0) -> ManagedProcess:
        """Start SuperNode ``index`` again after a crash, with the same key and node config.

        With SuperNode authentication the SuperLink refuses to activate a node id it still
        believes online (`Failed to activate SuperNode`, exit 305), which lasts until two missed
        heartbeats (2 x 30 s, Flower's; 2 x ``options.heartbeat_interval``) after the crash;
        this waits for that first.
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
            self.say(
                f"SuperLink marked node {node_id} offline after "
                f"{time.monotonic() - started:.0f}s; restarting SuperNode {index}"
            )
        return self.start_supernode(index, node_config=self.node_overrides.get(index))

    def clientapp_pids(self, index: int) -> set[int]:
        """Live ClientApp processes of SuperNode ``index`` (one per message in flight)."""
        return tagged_pids(self.tag, node=index, command="flwr-clientapp")

    def tasks_dir(self, index: int) -> Path:
        """Where SuperNode ``index``'s warm SuperExec marks the tasks it is running."""
        return self.state_dir(index) / "tasks"

    def tasks_in_flight(self, index: int) -> set[str]:
        """SuperNode ``index``'s messages being handled: its ClientApp processes (``pid:<n>``)
        and the tasks its warm SuperExec is running (``task:<id>``)."""
        running = {f"pid:{pid}" for pid in self.clientapp_pids(index)}
        directory = self.tasks_dir(index)
        if directory.is_dir():
            running |= {f"task:{path.stem}" for path in directory.glob("*.running")}
        return running

    def serverapp_pids(self) -> set[int]:
        """Live ServerApp processes of this deployment."""
        return tagged_pids(self.tag, command="flwr-serverapp")

    def kill_serverapp(self) -> list[int]:
        """SIGKILL the running ServerApp process(es) (a crash mid-run); returns the pids."""
        pids = sorted(self.serverapp_pids())
        for pid in pids:
            signal_process(pid, signal.SIGKILL, group=False)
        self.say(f"killed ServerApp (pids {pids})")
        return pids

    def restart_superlink(self) -> list[int]:
        """SIGKILL the SuperLink with its SuperExec and ServerApp (a crash of its machine), then
        start it again on the same state file; returns the pids killed. The SuperNodes keep
        running and reconnect with Flower's retries; a run in progress is left to the caller
        (its ServerApp is gone). Refused for a SuperLink whose state is in memory."""
        if self.superlink is None:
            raise DeploymentError("the deployment has no SuperLink to restart")
        if self.options.superlink_database == IN_MEMORY:
            raise DeploymentError(
                "a SuperLink with its state in memory forgets its nodes and runs on a restart"
            )
        pids = sorted({self.superlink.pid} | self.serverapp_pids())
        signal_process(self.superlink.pid, signal.SIGKILL, group=True)  # its SuperExec too
        for pid in pids[1:]:
            signal_process(pid, signal.SIGKILL, group=False)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.superlink.popen.wait(timeout=10)
        self.superlink.join_output()
        deadline = time.monotonic() + 10
        while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
            reap_orphans_if_safe(self.processes)
            time.sleep(0.05)
        self.say(f"killed SuperLink (pids {pids}); starting it on its state file")
        self.start_superlink(fresh=False)
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

    def run_in_process(self, run_config: Mapping[str, Any], output_dir: Path) -> Path:
        """The same federation without the deployment's processes: ``run_config`` run in this
        process, with each node's ``node_config`` (state under ``output_dir/node_<i>``) and the
        deployed processes' torch threads (the same reduction order, so the same floats), its
        results under ``output_dir``; returns its run directory. For reference runs."""
        if not run_config.get("run-name"):
            raise DeploymentError("run_in_process needs a run-name (the run's directory)")
        import torch

        from server_apps.inprocess import run_in_process

        n = self.options.num_supernodes
        node_configs = [
            {**self.node_config(i), "state-dir": str(output_dir / f"node_{i}")} for i in range(n)
        ]
        config = {**run_config, "output-dir": str(output_dir), "num-clients": n}
        threads = torch.get_num_threads()
        torch.set_num_threads(int(self.env()["OMP_NUM_THREADS"]))
        try:
            run_in_process(config, n, node_configs=node_configs)
        finally:
            torch.set_num_threads(threads)
        return output_dir / str(run_config["run-name"])

    def start_run(self, run_config: Mapping[str, Any] | None = None) -> ManagedProcess:
        """Start `flwr run <app> fedfm-local --stream` without waiting (see ``finish_run``)."""
        options = self.options
        config = resolve_run_config(run_config or {}, options.num_supernodes, options.app_dir)
        config_file = write_toml(options.workdir / "run-config.toml", config)
        # flwr run builds the FAB from a copy of its files: the same FAB, without walking .venv
        stage = stage_app(options.app_dir, options.workdir / "app" / f"run-{self._runs + 1}")
        command = [
            flower_command("flwr"),
            "run",
            str(stage),
            CONNECTION,
            "--stream",
            "--run-config",
            str(config_file),
        ]
        self.say(f"$ {shlex.join(command)}")
        self.say(f"run config: {json.dumps(config)}")
        self._runs += 1
        name = "flwr_run" if self._runs == 1 else f"flwr_run_{self._runs}"
        self._stages[name] = stage
        return self._start(
            name,
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
            self.say(f"`flwr run` still running after {timeout:.0f}s: stopping the run")
            # Stopped before its output is awaited: `flwr run --stream` ends with its run.
            if (running := run_id_from_lines(process.lines)) is not None:
                self.flwr("stop", str(running), CONNECTION, timeout=30)
        process.join_output()
        self._shown.close()
        shutil.rmtree(self._stages.pop(process.name, ""), ignore_errors=True)
        run_id = run_id_from_lines(process.lines)
        details = ""
        if status == "timeout":
            pass  # stopped above
        elif run_id is None:
            status = "not-started"
        else:
            status, details = final_run_status(
                flower_command("flwr"),
                CONNECTION,
                run_id,
                self.env(),
                cwd=str(self.options.workdir),
            )
        seconds = time.monotonic() - started
        run_dir = run_dir_from_lines(process.lines)
        result = RunResult(
            run_id, status, process.popen.returncode, seconds, run_dir, process.log_path, details
        )
        self.timings["run-s"] = seconds
        self.say(f"run {run_id}: {status} after {seconds:.1f}s; results in {run_dir}")
        return result

    def _echo(self, line: str) -> None:
        self._shown.feed(line)

    # -- stop ---------------------------------------------------------------------------------
    def live_pids(self) -> set[int]:
        """Every live process of this deployment (started here, or tagged descendants)."""
        pids = {p.pid for p in self.processes if p.alive()} | tagged_pids(self.tag)
        self.seen_pids |= pids
        return {pid for pid in pids if pid_alive(pid)}

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every process group and tagged process, SIGKILL what remains after ``grace``."""
        with shield_signals():
            self._stop(grace)

    def _stop(self, grace: float) -> None:
        if self._stopped and not self.live_pids():
            return
        self._stopped = True
        live = self.live_pids()
        if live:
            self.say(f"stopping {len(live)} process(es)")
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
            reap_orphans_if_safe(self.processes)
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
            self.say(f"killed {len(leftover)} process(es) that ignored SIGTERM: {sorted(leftover)}")
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(timeout=5)
            process.join_output()
        reap_orphans_if_safe(self.processes)
        deadline = time.monotonic() + 5
        while self.live_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
            reap_orphans_if_safe(self.processes)
        remaining = self.live_pids()
        if remaining:
            self.say(f"WARNING: processes still alive: {sorted(remaining)}")
        elif self.ports is not None:
            self.ports.release()  # nothing of ours listens on them any more
            self.ports = None
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)


def node_config_string(config: Mapping[str, Any]) -> str:
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
