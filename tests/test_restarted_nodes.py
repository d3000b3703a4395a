"""A message a restarted SuperNode's predecessor took is answered with Flower's node-unavailable
error at once (``fedfm_flower.deploy.restarted_nodes``), on Flower's own state classes, in
memory and in SQLite; Flower alone leaves the ServerApp waiting for it."""

from __future__ import annotations

import importlib
import secrets
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from fedfm_flower.deploy import restarted_nodes

HEARTBEAT_S = 30.0  # Flower's default: a node is offline 2 x this after its last heartbeat
LAST_HEARTBEAT_S = 0.01  # the crashed node's last heartbeat, so its silence lapses at once


class Federation:
    """A LinkState with one run and one registered, activated node, and a grid on it."""

    def __init__(self, database: str) -> None:
        from flwr.common.constant import NOOP_ACCOUNT_NAME, NOOP_FLWR_AID
        from flwr.server.superlink.linkstate import LinkStateFactory
        from flwr.supercore.constant import NOOP_FEDERATION_ID
        from flwr.supercore.object_store import ObjectStoreFactory
        from flwr.supercore.task_identity import TaskIdentity
        from flwr.superlink.federation import NoOpFederationManager
        from flwr.superlink.grid import InMemoryGrid

        factory = LinkStateFactory(database, NoOpFederationManager(), ObjectStoreFactory())
        self.state = factory.state()
        run_id = self.state.create_run(
            None, None, None, {}, NOOP_FEDERATION_ID, None, None, "serverapp"
        )
        run = self.state.get_run_info(run_ids=[run_id])[0]
        TaskIdentity.task_id, TaskIdentity.run_id = run.primary_task_id, run_id
        TaskIdentity.node_id = 1  # the SuperLink's
        key = secrets.token_bytes(32)
        self.node = self.state.create_node(NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, key, HEARTBEAT_S)
        assert self.state.activate_node(self.node, HEARTBEAT_S)
        self.grid = InMemoryGrid(state_factory=factory)
        self.grid.set_run(run)

    def send(self, tag: str) -> str:
        """Push one train message to the node; its id."""
        content = RecordDict({"config": ConfigRecord({"tag": tag})})
        (message_id,) = self.grid.push_messages([Message(content, self.node, "train")])
        return message_id

    def node_pulls(self) -> list[Message]:
        """What the node's SuperNode pulls now."""
        return self.state.get_message_ins(node_id=self.node, limit=None)

    def node_restarts(self) -> None:
        """The node's process dies, its heartbeats lapse, and a new process starts. The last
        heartbeat announces a tiny interval, so the lapse takes milliseconds of the clock,
        not a race with it."""
        assert not self.state.activate_node(self.node, HEARTBEAT_S)  # Flower: still online
        assert self.state.acknowledge_node_heartbeat(self.node, LAST_HEARTBEAT_S)
        time.sleep(5 * LAST_HEARTBEAT_S)
        assert self.state.activate_node(self.node, HEARTBEAT_S)

    def replies(self, message_id: str) -> list[Message]:
        """What the ServerApp gets when it asks for the reply to ``message_id``."""
        return list(self.grid.pull_messages([message_id]))


@pytest.fixture(params=["in-memory", "sqlite"])
def database(request, tmp_path: Path) -> str:
    """Flower's in-memory state, or SQLite on a file."""
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME

    return FLWR_IN_MEMORY_DB_NAME if request.param == "in-memory" else str(tmp_path / "s.db")


@pytest.fixture
def answering(database, flowers_link_states) -> Federation:
    """A federation on a state whose SuperLink answers for restarted nodes."""
    assert restarted_nodes.answer_for_restarted_nodes() is True
    return Federation(database)


def test_flower_alone_waits_for_a_message_the_restarted_nodes_predecessor_took(
    database, flowers_link_states
) -> None:
    federation = Federation(database)
    lost = federation.send("lost")
    assert len(federation.node_pulls()) == 1
    federation.node_restarts()
    assert federation.replies(lost) == []  # and so on until the round times out


def test_a_message_the_predecessor_took_is_answered_with_the_node_unavailable_error(
    answering,
) -> None:
    from flwr.common.constant import ErrorCode

    federation = answering
    lost = federation.send("lost")
    assert len(federation.node_pulls()) == 1
    federation.node_restarts()
    late = federation.send("sent after the restart")
    assert [m.metadata.message_id for m in federation.node_pulls()] == [late]

    (reply,) = federation.replies(lost)
    assert reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE
    assert reply.metadata.reply_to_message_id == lost
    # answered once: Flower deleted the instruction, and says so if asked again
    (again,) = federation.replies(lost)
    assert again.has_error() and again.error.code == ErrorCode.MESSAGE_UNAVAILABLE
    assert federation.replies(late) == []  # the new process's message waits for its reply


def test_a_reply_stored_before_the_restart_is_delivered_not_replaced(answering) -> None:
    federation = answering
    answered = federation.send("answered")
    (instruction,) = federation.node_pulls()
    reply = Message(RecordDict({"config": ConfigRecord({"ok": 1})}), reply_to=instruction)
    reply.metadata.__dict__["_message_id"] = reply.object_id  # as a SuperNode sends it
    assert federation.state.store_message_res(reply) is not None
    federation.node_restarts()
    (got,) = federation.replies(answered)
    assert not got.has_error() and got.content["config"]["ok"] == 1


def test_a_node_back_after_lapsed_heartbeats_keeps_its_messages(answering) -> None:
    federation = answering
    held = federation.send("held")
    assert len(federation.node_pulls()) == 1
    # The same process's heartbeats lapse (its last one announced a tiny interval), then one
    # arrives.
    assert federation.state.acknowledge_node_heartbeat(federation.node, LAST_HEARTBEAT_S)
    time.sleep(5 * LAST_HEARTBEAT_S)
    assert federation.state.acknowledge_node_heartbeat(federation.node, HEARTBEAT_S)
    assert federation.replies(held) == []  # still the process's to answer
    assert restarted_nodes.activated_at(federation.state).keys() == {federation.node}


def test_another_flower_source_is_left_alone_and_said_so(flowers_link_states, capsys) -> None:
    cls = flowers_link_states["SqlLinkState"]

    def get_message_res(self, message_ids, run_id):  # Flower's name, another body
        return []

    cls.get_message_res = get_message_res
    before = {name: vars(c).get("activate_node") for name, c in flowers_link_states.items()}
    assert restarted_nodes.answer_for_restarted_nodes() is False
    assert cls.get_message_res is get_message_res
    assert {name: vars(c).get("activate_node") for name, c in flowers_link_states.items()} == (
        before
    )
    assert "SqlLinkState.get_message_res is not the code this knows" in capsys.readouterr().err


def test_another_flower_version_is_left_alone(flowers_link_states, monkeypatch, capsys) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.99.0")
    assert restarted_nodes.answer_for_restarted_nodes() is False
    assert not any(hasattr(c.get_message_res, "__wrapped__") for c in flowers_link_states.values())
    assert "Flower 1.99.0" in capsys.readouterr().err
