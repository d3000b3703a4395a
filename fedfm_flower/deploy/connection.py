"""Where the federation listens and how ``flwr`` reaches it: loopback ports and the connection.

The SuperLink serves its Fleet, Control and Runtime APIs on 127.0.0.1:<base-port>; SuperNode i
runs its ClientApp runtime on base-port + 1 + i. Every ``flwr`` command of the launcher uses
the connection ``fedfm-local`` in ``$FLWR_HOME/config.toml``.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

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
