"""What shapes one local deployment: its options, the loopback address, the user-facing error.

Every other module of ``fedfm_flower.deploy`` builds on these.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fedfm_flower.deploy.superlink import DEFAULT_LOCK_WAIT_S, check_lock_wait
from fedfm_flower.deploy.supernode import (
    DEFAULT_MAX_POLL_INTERVAL,
    DEFAULT_POLL_INTERVAL,
    check_heartbeat_interval,
    check_poll_intervals,
)

ROOT = Path(__file__).resolve().parents[2]  # the repository: the default app, scripts/, deploy/
HOST = "127.0.0.1"  # the only address the launcher ever binds to or dials
DEFAULT_BASE_PORT = 19190
IN_MEMORY = ":flwr-in-memory:"  # the SuperLink's --database for Flower's in-memory state
CONNECTION = "fedfm-local"  # the flwr connection (in <workdir>/flwr-home/config.toml)


class DeploymentError(RuntimeError):
    """A failure with a message meant for the user (what happened, where to look)."""


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
    # Extra node-config entries of every SuperNode, e.g. {"warm-worker": False}.
    node_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Shortest and longest waits of the SuperNodes (fedfm_flower.deploy.supernode); the first
    # is also the SuperExecs' task polling. None: plain `flower-supernode` with Flower's own
    # waits (3 s, 0.5 s; SuperExec 1 s).
    poll_interval: float | None = DEFAULT_POLL_INTERVAL
    max_poll_interval: float = DEFAULT_MAX_POLL_INTERVAL
    # Each node's ClientApp tasks in one kept process (fedfm_flower.deploy.superexec) instead of
    # a flwr-clientapp process per message; with the short waits' SuperNode only (poll_interval
    # None: plain flower-supernode, Flower's path throughout).
    warm_executor: bool = True
    # The SuperNodes' heartbeat interval (fedfm_flower.deploy.supernode), >= 10 s: a crashed
    # node is marked offline after twice it. None: Flower's 30 s. Needs poll_interval.
    heartbeat_interval: float | None = None
    # The SuperLink's --database: None, a fresh SQLite file <workdir>/superlink/state.db;
    # ":flwr-in-memory:", Flower's in-memory state (no SQLite, nothing survives the SuperLink).
    superlink_database: str | None = None
    # Seconds the SuperLink's SQLite connections wait for the write lock; its expired task
    # tokens are then swept at most once a second (fedfm_flower.deploy.superlink). None: plain
    # `flower-superlink` (5 s, a sweep on every status read).
    superlink_lock_wait: float | None = DEFAULT_LOCK_WAIT_S
    # How long a warm executor's task waits for its message's next object (seconds; None:
    # superexec.PULL_PATIENCE_S, 90). Raise it for many SuperNodes on few cores.
    pull_patience: float | None = None
    # The warm executors forked from one process that imported their libraries once
    # (fedfm_flower.deploy.forkserver), sharing those pages: many SuperNodes on one machine.
    # Needs warm_executor.
    shared_imports: bool = False

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
        if self.poll_interval is None:
            self.warm_executor = False
        if self.poll_interval is not None:
            try:
                check_poll_intervals(self.poll_interval, self.max_poll_interval)
            except ValueError as err:
                raise ValueError(f"--poll-interval/--max-poll-interval: {err}") from None
        if self.superlink_lock_wait is not None:
            try:
                check_lock_wait(self.superlink_lock_wait)
            except ValueError as err:
                raise ValueError(f"--superlink-lock-wait: {err}") from None
        if self.pull_patience is not None and not 0 < self.pull_patience < float("inf"):
            raise ValueError(
                f"pull patience must be a positive number of seconds, not {self.pull_patience!r}"
            )
        if self.shared_imports and not self.warm_executor:
            raise ValueError("--shared-imports needs the warm executors (no --no-warm-executor)")
        if self.heartbeat_interval is not None:
            if self.poll_interval is None:
                raise ValueError("--heartbeat-interval needs the short waits' SuperNode")
            try:
                check_heartbeat_interval(self.heartbeat_interval)
            except ValueError as err:
                raise ValueError(f"--heartbeat-interval: {err}") from None

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
