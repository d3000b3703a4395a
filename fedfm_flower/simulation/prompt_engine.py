"""Prompt hand-offs in Flower's simulation engine: messages picked up when pushed, replies seen
when stored, instead of on the engine's and the grid's 0.1 s ticks.

Flower's simulation engine (``flwr.server.superlink.fleet.vce.vce_api``) moves messages between
the in-memory LinkState and the Ray backend with two threads. Its extractor,
``add_messages_to_queue``, asks the LinkState for every node's next message and then sleeps
0.1 s, so a round's messages wait 0-0.1 s before any client starts; each of its passes asks
every node, and each ask scans every stored message (O(nodes x messages) while a round's
messages wait for their replies: 15-30 ms a pass at 100 clients, pure Python holding the GIL).
Its injector, ``put_message_into_state``, stores each reply, which the grid then finds on its
next pull (``server_apps.polling``: pauses of up to 0.1 s).

``install`` replaces both functions in that module (``run_api`` reads them when it starts the
threads) with:

- ``prompt_add_messages_to_queue``: the same asks (``state.get_message_ins(node, limit=1)`` in
  the node mapping's order, so the same messages reach the queue in the same order) but only for
  the nodes that have an undelivered message, found by one pass over the store under its lock;
  it wakes when ``PUSHED`` is set (``PromptGrid.push_messages`` sets it after a batch is stored)
  and otherwise every 0.1 s, Flower's own tick, so pushes that do not set it are still seen;
- ``prompt_put_message_into_state``: Flower's loop, which then sets ``REPLIED``;
  ``server_apps.polling.push_and_pull`` waits on it between pulls instead of sleeping.

Only the timing changes: the same messages reach the same ClientApp with the same content, so
results are bit-identical (``tests/test_simulation.py`` runs a simulation with and without).
Guarded: installed only when Flower's two functions have the source this module was written
against (``FLOWER_SOURCES``: Flower 1.41.0 and 1.42.0, whose engine modules are identical); on
any other source it warns and leaves Flower's.
``FEDFM_PROMPT_ENGINE=0`` in the environment leaves Flower's too (for benchmarks comparing them).
"""

from __future__ import annotations

import hashlib
import inspect  # here: the ClientApp's module imports this one in every deployed process
import logging
import os
import sys
import threading
from collections import Counter
from queue import Empty, Queue
from typing import Any

log = logging.getLogger("fedfm_flower")

ENGINE_MODULE = "flwr.server.superlink.fleet.vce.vce_api"
ENV_SWITCH = "FEDFM_PROMPT_ENGINE"
TICK_S = 0.1  # Flower's own pause between the extractor's passes
# sha256 (first 16 hex digits) of inspect.getsource of the functions replaced, by name
# (the same in Flower 1.41.0 and 1.42.0).
FLOWER_SOURCES = {
    "add_messages_to_queue": {"953f4bd41a931a77"},
    "put_message_into_state": {"3622eb5bfcd9cd1a"},
}

PUSHED = threading.Event()  # set after the grid stored a batch of messages
REPLIED = threading.Event()  # set after the engine stored a reply


def source_digest(function: Any) -> str:
    """The first 16 hex digits of the sha256 of ``function``'s source."""

    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def unknown_sources(functions: dict[str, Any], known: dict[str, set[str]]) -> list[str]:
    """The names among ``functions`` whose source digest is not one of ``known[name]`` (a
    function without source, or None, is unknown too)."""
    unknown = []
    for name, function in functions.items():
        try:
            if function is None or source_digest(function) not in known[name]:
                unknown.append(name)
        except (OSError, TypeError):  # no source to read
            unknown.append(name)
    return unknown


def undelivered_nodes(state: Any) -> Counter[int] | None:
    """Undelivered messages per destination node in an in-memory LinkState, or None when
    ``state`` does not keep them where Flower 1.42's ``InMemoryLinkState`` does."""
    store, lock = getattr(state, "message_ins_store", None), getattr(state, "lock", None)
    if not isinstance(store, dict) or lock is None:
        return None
    with lock:
        return Counter(
            message.metadata.dst_node_id
            for message in store.values()
            if message.metadata.delivered_at == ""
        )


def prompt_add_messages_to_queue(
    state: Any, queue: Queue, nodes_mapping: dict[int, Any], f_stop: threading.Event
) -> None:
    """Flower's extractor, woken by ``PUSHED``, asking only nodes with undelivered messages."""
    while not f_stop.is_set():
        PUSHED.clear()  # a push during the pass sets it again: no pause before the next pass
        waiting = undelivered_nodes(state)
        queued, more = 0, False
        for node_id in nodes_mapping.keys():
            if waiting is not None and not waiting.get(node_id):
                continue
            for message in state.get_message_ins(node_id=node_id, limit=1):
                queue.put(message)
                queued += 1
            more = more or (waiting is not None and waiting.get(node_id, 0) > 1)
        if queued and more:
            continue  # a node had more than one: its next one now, not after a tick
        PUSHED.wait(TICK_S)


def prompt_put_message_into_state(state: Any, queue: Queue, f_stop: threading.Event) -> None:
    """Flower's injector: store each reply in the LinkState, then set ``REPLIED``."""
    while not f_stop.is_set():
        try:
            reply = queue.get(timeout=1.0)
        except Empty:
            continue
        state.store_message_res(reply)
        REPLIED.set()


REPLACEMENTS = {
    "add_messages_to_queue": prompt_add_messages_to_queue,
    "put_message_into_state": prompt_put_message_into_state,
}


def install() -> bool:
    """Put the prompt functions into Flower's engine module when it is loaded and known;
    True when they are in place (now or before)."""
    engine = sys.modules.get(ENGINE_MODULE)
    if engine is None or os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    current = {name: getattr(engine, name, None) for name in REPLACEMENTS}
    if all(current[name] is ours for name, ours in REPLACEMENTS.items()):
        return True
    unknown = [
        name
        for name, function in current.items()
        if function is None
        or function is not REPLACEMENTS[name]
        and source_digest(function) not in FLOWER_SOURCES[name]
    ]
    if unknown:
        print(
            f"fedfm_flower.simulation.prompt_engine: Flower's {', '.join(unknown)} is not the "
            "code this project knows; the simulation keeps Flower's 0.1 s hand-offs",
            file=sys.stderr,
        )
        return False
    for name, ours in REPLACEMENTS.items():
        setattr(engine, name, ours)
    log.debug("simulation engine: prompt hand-offs in place")
    return True
