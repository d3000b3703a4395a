"""The wake-up call from a SuperNode to its warm SuperExec: "a message is here, poll now".

Without it the SuperExec finds a new task only by polling its SuperNode's runtime API, so an
idle pair trades CPU (a local HTTP request per poll, served by the SuperNode) against the delay
before a message's task starts. With it the SuperNode says when it stored a message, and the
SuperExec can poll seldom while idle.

The channel is a Linux abstract-namespace UNIX datagram socket named by the SuperNode: no file
to clean up, no path length limit, and a send to a name nobody listens on fails at once (a
SuperExec that is restarting, or Flower's own, which does not listen). A send that fails is
ignored: the SuperExec's own polls still find the task. Where abstract sockets do not exist
(not Linux) ``listen`` returns False and the SuperExec keeps polling at its usual pace.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from collections.abc import Callable

PREFIX = "fedfm-superexec-wake"


def new_name() -> str:
    """A name for this process's channel, unique on the machine."""
    return f"{PREFIX}-{os.getpid()}-{secrets.token_hex(4)}"


def _address(name: str) -> str:
    return "\0" + name  # the abstract namespace


def send(name: str) -> bool:
    """Wake whoever listens on ``name``; False when nobody does (or the send failed)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(b"\1", _address(name))
    except OSError:
        return False
    return True


def listen(name: str, on_wake: Callable[[], object]) -> bool:
    """Call ``on_wake`` from a daemon thread for every wake sent to ``name``; False, with
    nothing started, when the name cannot be bound (taken, or no abstract sockets here)."""
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        receiver.bind(_address(name))
    except OSError:
        receiver.close()
        return False

    def receive() -> None:
        while True:
            try:
                receiver.recv(64)
            except OSError:
                return
            on_wake()

    threading.Thread(target=receive, name="superexec-wake", daemon=True).start()
    return True
