"""Where the federation listens and how ``flwr`` reaches it: loopback ports and the connection.

The SuperLink serves its Fleet, Control and Runtime APIs on 127.0.0.1:<base-port>; SuperNode i
runs its ClientApp runtime on base-port + 1 + i. Every ``flwr`` command of the launcher uses
the connection ``fedfm-local`` in ``$FLWR_HOME/config.toml``.

A deployment reserves its block of ports (``reserve_ports``) for as long as it lives: a lock
file per base port, in a directory of this user's under the temporary directory, that no other
deployment of this user takes meanwhile. A free port alone is no reservation: two deployments
starting at once would find the same block free, and their SuperLinks (gRPC sets SO_REUSEPORT)
would both listen on it, each answering the other's clients.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fedfm_flower.deploy.options import CONNECTION, DEFAULT_BASE_PORT, HOST, DeploymentError
from fedfm_flower.deploy.runs import write_toml


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


@dataclass
class PortBlock:
    """``count`` consecutive ports from ``base`` on 127.0.0.1, reserved for one deployment
    until ``release`` (or until its process ends)."""

    base: int
    count: int
    lock: IO[bytes] | None

    def release(self) -> None:
        """Give the block back to this user's other deployments."""
        if self.lock is not None:
            self.lock.close()  # closing the file drops its flock
            self.lock = None


def port_locks_dir() -> Path:
    """Where this user's deployments hold their ports' lock files (only this user may write)."""
    path = Path(tempfile.gettempdir()) / f"fedfm-flower-ports-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _lock_base(base: int) -> IO[bytes] | None:
    """The held lock of block ``base``, or None when another deployment holds it."""
    handle = (port_locks_dir() / f"{base}.lock").open("ab")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def reserve_ports(requested: int | None, count: int) -> PortBlock:
    """A block of ``count`` free consecutive ports on 127.0.0.1 that no other deployment of
    this user holds, reserved until released.

    An explicit request must be free and unreserved; the default moves up in blocks of 100
    past busy or reserved ones.
    """
    bases = [requested] if requested is not None else range(DEFAULT_BASE_PORT, 60000, 100)
    for base in bases:
        lock = _lock_base(base)
        if lock is None:
            if requested is not None:
                raise DeploymentError(
                    f"base port {base} on {HOST} is held by another running deployment of "
                    f"this user (lock {port_locks_dir() / f'{base}.lock'}); pick another "
                    "--base-port"
                )
            continue
        busy = [p for p in range(base, base + count) if not port_is_free(p)]
        if not busy:
            return PortBlock(base, count, lock)
        lock.close()
        if requested is not None:
            raise DeploymentError(
                f"port(s) {busy} on {HOST} are in use; pick another --base-port "
                f"(this deployment needs {count} consecutive ports)"
            )
    raise DeploymentError(f"no {count} consecutive free ports found on {HOST}")


def free_port() -> int:
    """A port the system picks as free on 127.0.0.1 (when the planned one is taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


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
