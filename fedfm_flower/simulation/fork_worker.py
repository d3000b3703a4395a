"""A simulation worker forked by ``fedfm_flower.simulation.fork_engine``: it runs the ClientApp on
the
messages its backend sends.

The worker talks to its backend over one Unix stream socket, its descriptor 0 (the fork server
attaches it as the child's stdin; ``python -m fedfm_flower.simulation.fork_worker`` runs the same
loop when no fork server is at hand). Each frame is an 8-byte big-endian length and a pickle:

- backend -> worker: ``("app", module, attribute, sys_path)`` once, the ClientApp to run
  (``getattr(import_module(module), attribute)`` with the simulation process's ``sys.path``);
  then ``("run", message, context)`` per message;
- worker -> backend: ``("ready",)`` for the app, or ``("ok", reply, context)``, or
  ``("load-error", text)`` (the app could not be loaded), or ``("raised", text)`` (the
  ClientApp raised; ``text`` holds its traceback).

The socket is a private pair between the simulation process and its own child, so both sides
trust the pickles, as Ray's actors trust theirs. The worker ends when the backend closes its
end.
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import struct
import sys
import traceback
from collections.abc import Sequence
from typing import Any

FRAME_HEADER = struct.Struct(">Q")


class ChannelClosed(EOFError):
    """The other end of a worker's channel closed (or broke) before a whole frame came."""


def send_frame(channel: socket.socket, value: Any) -> None:
    """Send ``value`` as one frame: its pickle's length, then the pickle."""
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    channel.sendall(FRAME_HEADER.pack(len(payload)) + payload)


def _receive_exactly(channel: socket.socket, size: int) -> bytearray:
    data = bytearray(size)  # filled in place: a large message is held once, not in pieces too
    view, done = memoryview(data), 0
    while done < size:
        try:
            count = channel.recv_into(view[done:], min(size - done, 1 << 24))
        except OSError as err:
            raise ChannelClosed(str(err)) from None
        if not count:
            raise ChannelClosed(f"the channel closed with {size - done} of {size} bytes to come")
        done += count
    return data


def receive_frame(channel: socket.socket) -> Any:
    """The next frame's value; ``ChannelClosed`` when the channel ends first."""
    (size,) = FRAME_HEADER.unpack(_receive_exactly(channel, FRAME_HEADER.size))
    return pickle.loads(_receive_exactly(channel, size))


def load_app(module: str, attribute: str, path: Sequence[str]) -> Any:
    """The ClientApp ``module:attribute``, imported with ``path`` ahead of this process's own."""
    sys.path[:0] = [entry for entry in path if entry not in sys.path]
    return getattr(importlib.import_module(module), attribute)


def serve(channel: socket.socket) -> int:
    """Answer the backend's frames until it closes the channel; 0 then."""
    app = None
    while True:
        try:
            frame = receive_frame(channel)
        except ChannelClosed:
            return 0
        if frame[0] == "app":
            try:
                app = load_app(*frame[1:])
                answer: tuple[Any, ...] = ("ready",)
            except Exception:  # noqa: BLE001 - reported to the backend, which fails the message
                answer = ("load-error", traceback.format_exc())
        elif frame[0] == "run" and app is not None:
            _, message, context = frame
            try:
                reply = app(message=message, context=context)
                answer = ("ok", reply, context)
            except Exception:  # noqa: BLE001 - as Flower's actor: the message fails, not the worker
                answer = ("raised", traceback.format_exc())
        else:
            answer = ("load-error", f"a {frame[0]!r} frame before the ClientApp was loaded")
        try:
            payload = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - a reply that cannot travel fails its message
            payload = pickle.dumps(("raised", traceback.format_exc()))
        try:
            channel.sendall(FRAME_HEADER.pack(len(payload)) + payload)
        except OSError:  # the backend is gone
            return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the backend on descriptor 0 (the fork server's child, or ``python -m``)."""
    channel = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # nothing else reads the channel by accident through stdin
    os.close(devnull)
    try:
        return serve(channel)
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
