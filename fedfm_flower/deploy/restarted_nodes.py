"""An error reply, at once, for a message a restarted SuperNode's predecessor took and lost.

A SuperNode that dies after pulling a message takes the message with it. Flower's SuperLink
(1.42) answers the ServerApp's request for the reply with a "node unavailable" error only while
the node is offline at that moment (``check_node_availability_for_in_message``). A SuperNode
restarted with the same key is online again seconds after its predecessor's heartbeats lapse
(``activate_node`` succeeds once the node is offline), and from then on the SuperLink reports
nothing for the lost message: the ServerApp waits for it until the round times out. At 50
nodes that turned a round ending ~20 s after the kill into 333 s (docs/deployment.md, "Chaos
runs").

Here the state remembers when ``activate_node`` last succeeded for each node, which is the start
of a SuperNode process (it activates once, when it connects; a heartbeat that brings back a
node whose heartbeats lapsed does not count, since that process still holds its messages). A
message the SuperLink handed to that node before the activation, still unanswered and not
expired, gets Flower's own node-unavailable error reply the next time the ServerApp asks for
it, as if the node had been offline then; the ServerApp counts the client as failed and the
round goes on. Every other message is Flower's business, as before.

The change applies to the state classes and sources it was written against (``FLOWER_SOURCES``,
Flower 1.42's ``InMemoryLinkState`` and ``SqlLinkState``); elsewhere the SuperLink keeps
Flower's behaviour and says so on stderr. What is remembered lives in the SuperLink process: a
restarted SuperLink starts with nothing remembered, and Flower's behaviour, until nodes start.

Imports inside functions keep ``flwr.server``, ``flwr.supercore`` and ``sqlalchemy`` out of this
module's start-up.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

from fedfm_flower.deploy.known_flower import flower_version, is_known, refuse
from fedfm_flower.simulation.prompt_engine import source_digest

UTILS_MODULE = "flwr.server.superlink.linkstate.utils"
STATE_CLASSES = {
    "flwr.server.superlink.linkstate.in_memory_linkstate": "InMemoryLinkState",
    "flwr.server.superlink.linkstate.sql_linkstate": "SqlLinkState",
}
ERROR_REPLY = "create_message_error_unavailable_res_message"
# sha256 (first 16 hex digits) of inspect.getsource of each function this relies on.
FLOWER_SOURCES = {
    "InMemoryLinkState.get_message_res": "3e91c65629fc5b48",
    "InMemoryLinkState.activate_node": "ddd272f4a52bcc3e",
    "SqlLinkState.get_message_res": "5c1b460981b4e8d0",
    "SqlLinkState.activate_node": "a06be1bac7e13f41",
    ERROR_REPLY: "e0125c95da36c24a",
}
ACTIVATED = "_fedfm_activated_at"  # on a state: node id -> when activate_node last succeeded
_LOCK = threading.Lock()
WHO = "fedfm_flower.deploy.superlink"


def activated_at(state: Any) -> dict[int, datetime]:
    """When each node of ``state`` last started (``activate_node`` succeeded), as remembered."""
    with _LOCK:
        return dict(state.__dict__.get(ACTIVATED, {}))


def _remembering_activations(activate_node: Callable[..., bool]) -> Callable[..., bool]:
    """``activate_node`` that remembers when it succeeded for each node."""
    from flwr.supercore.date import now

    @functools.wraps(activate_node)
    def activate_and_remember(self: Any, node_id: int, heartbeat_interval: float) -> bool:
        activated = activate_node(self, node_id, heartbeat_interval)
        if activated:
            with _LOCK:
                self.__dict__.setdefault(ACTIVATED, {})[node_id] = now()
        return activated

    return activate_and_remember


def lost(message: Any, run_id: int, started: dict[int, datetime], replied: set[str]) -> bool:
    """Whether ``message`` (an instruction of run ``run_id``) went to a node that started again
    after the SuperLink handed it out, has no reply and has not expired."""
    from flwr.supercore.date import now

    metadata = message.metadata
    start = started.get(metadata.dst_node_id)
    return (
        start is not None
        and metadata.run_id == run_id
        and metadata.delivered_at != ""
        and metadata.message_id not in replied
        and metadata.created_at + metadata.ttl > now().timestamp()
        and datetime.fromisoformat(metadata.delivered_at) < start
    )


def _in_memory_instructions(state: Any, message_ids: set[str]) -> tuple[list[Any], set[str]]:
    """The stored instructions among ``message_ids`` and the ids of those with a reply."""
    with state.lock:
        found = [state.message_ins_store[i] for i in message_ids if i in state.message_ins_store]
        replied = {i for i in message_ids if i in state.message_ins_id_to_message_res_id}
    return found, replied


def _sql_instructions(state: Any, message_ids: set[str]) -> tuple[list[Any], set[str]]:
    """As ``_in_memory_instructions``, read from the SQLite state as Flower reads it."""
    from flwr.server.superlink.linkstate import sql_linkstate as flower
    from sqlalchemy import select

    with state.session() as session:
        rows = session.scalars(
            select(flower.MessageInsModel).where(flower.MessageInsModel.message_id.in_(message_ids))
        ).all()
        found = []
        for row in rows:
            record = flower._message_model_to_dict(row)  # noqa: SLF001 - Flower's own conversion
            flower.convert_sint64_values_in_dict_to_uint64(
                record, ["run_id", "src_node_id", "dst_node_id"]
            )
            found.append(flower.dict_to_message(record))
        replied = set(
            session.scalars(
                select(flower.MessageResModel.reply_to_message_id).where(
                    flower.MessageResModel.reply_to_message_id.in_(message_ids)
                )
            ).all()
        )
    return found, replied


INSTRUCTIONS = {"InMemoryLinkState": _in_memory_instructions, "SqlLinkState": _sql_instructions}


def _answering_for_restarted_nodes(
    get_message_res: Callable[..., list[Any]],
    instructions: Callable[[Any, set[str]], tuple[list[Any], set[str]]],
    error_reply: Callable[[Any, str], Any],
) -> Callable[..., list[Any]]:
    """``get_message_res`` that answers each lost message (``lost``) with Flower's
    node-unavailable error reply and leaves every other id to Flower."""

    @functools.wraps(get_message_res)
    def get_message_res_answering(self: Any, message_ids: set[str], run_id: int) -> list[Any]:
        started = activated_at(self)
        gone: list[Any] = []
        if started and message_ids:
            found, replied = instructions(self, message_ids)
            gone = [m for m in found if lost(m, run_id, started, replied)]
            message_ids.difference_update(m.metadata.message_id for m in gone)
        replies = get_message_res(self, message_ids, run_id)
        for message in gone:
            reply = error_reply(message.metadata, "node_unavail")
            self._store_generated_message(reply)  # noqa: SLF001 - as Flower stores its own
            replies.append(reply)
        return replies

    return get_message_res_answering


def answer_for_restarted_nodes() -> bool:
    """Install the change of the module doc on Flower's state classes; False, changing nothing,
    on a Flower whose code this was not written against."""

    if not is_known(flower_version()):
        return refuse(WHO, "LinkState", "a restarted node's lost messages wait out the round")
    utils = importlib.import_module(UTILS_MODULE)
    error_reply = getattr(utils, ERROR_REPLY, None)
    classes = {
        name: getattr(importlib.import_module(module), name, None)
        for module, name in STATE_CLASSES.items()
    }
    originals: dict[str, Any] = {ERROR_REPLY: error_reply}
    for name, cls in classes.items():
        for method in ("get_message_res", "activate_node"):
            function = getattr(cls, method, None)
            originals[f"{name}.{method}"] = getattr(function, "__wrapped__", function)
    for key, function in originals.items():
        if function is None or source_digest(function) != FLOWER_SOURCES[key]:
            return refuse(WHO, key, "a restarted node's lost messages wait out the round")
    for name, cls in classes.items():
        cls.activate_node = _remembering_activations(originals[f"{name}.activate_node"])
        cls.get_message_res = _answering_for_restarted_nodes(
            originals[f"{name}.get_message_res"], INSTRUCTIONS[name], error_reply
        )
    return True
