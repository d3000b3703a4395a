"""The simulation engine's prompt hand-offs (``fedfm_flower.simulation.prompt_engine``) on Flower's
own
in-memory LinkState and grid: the same messages, in the same order, as Flower's extractor; the
replies stored and signalled; installed only over the Flower code it knows."""

from __future__ import annotations

import threading
import time
from queue import Empty, Queue

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from fedfm_flower.simulation import prompt_engine
from fedfm_flower.simulation.prompt_engine import (
    PUSHED,
    REPLIED,
    install,
    prompt_add_messages_to_queue,
    prompt_put_message_into_state,
    undelivered_nodes,
)
from server_apps.polling import PromptGrid

vce_api = pytest.importorskip("flwr.server.superlink.fleet.vce.vce_api")

NODES = 6


def federation():
    """Flower's in-memory LinkState with a run and NODES nodes, and a grid on it (as
    ``flwr.simulation.run_simulation`` builds them)."""
    from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
    from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.federation import NoOpFederationManager
    from flwr.superlink.grid import InMemoryGrid

    factory = LinkStateFactory(
        FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()
    )
    state = factory.state()
    run = Run.create_empty(run_id=7)
    run.primary_task_id = 11
    run.federation_id = NOOP_FEDERATION_ID
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[11] = Task(task_id=11, run_id=run.run_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run.run_id, 1  # SuperLink
    mapping = vce_api._register_nodes(NODES, factory)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, grid, mapping


def messages(grid, nodes: list[int], tag: str) -> list[Message]:
    """One train message per node in ``nodes``, its content naming ``tag`` and the node."""
    return [
        grid.create_message(
            RecordDict({"config": ConfigRecord({"tag": f"{tag}-{node}"})}), "train", node, ""
        )
        for node in nodes
    ]


def drain(queue: Queue, count: int, timeout: float = 10.0) -> list[Message]:
    """``count`` messages from ``queue`` (fails after ``timeout`` seconds)."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        got.append(queue.get(timeout=max(0.01, deadline - time.monotonic())))
    return got


def run_extractor(function, state, mapping) -> tuple[Queue, threading.Event, threading.Thread]:
    queue: Queue = Queue()
    stop = threading.Event()
    thread = threading.Thread(target=function, args=(state, queue, mapping, stop), daemon=True)
    thread.start()
    return queue, stop, thread


def tags(got: list[Message]) -> list[str]:
    return [str(m.content["config"]["tag"]) for m in got]


def test_the_prompt_extractor_queues_what_flowers_queues_in_the_same_order() -> None:
    results = {}
    for name, function in (
        ("flower", vce_api.add_messages_to_queue),
        ("prompt", prompt_add_messages_to_queue),
    ):
        state, grid, mapping = federation()
        nodes = list(mapping)
        # two messages for node 2 and one for three others, pushed before the thread starts
        pushed = [nodes[4], nodes[2], nodes[0], nodes[2], nodes[5]]
        ids = grid.push_messages(messages(grid, pushed, "a"))
        assert len(list(ids)) == 5
        queue, stop, thread = run_extractor(function, state, mapping)
        got = drain(queue, 5)
        stop.set()
        thread.join(timeout=5)
        with pytest.raises(Empty):
            queue.get_nowait()  # nothing twice
        assert all(m.metadata.delivered_at for m in got)
        # node ids are drawn anew per federation: compare partitions (the mapping's values)
        results[name] = [
            (mapping[m.metadata.dst_node_id], t.replace(str(m.metadata.dst_node_id), "n"))
            for m, t in zip(got, tags(got), strict=True)
        ]
    assert results["prompt"] == results["flower"]
    # Flower's order: a pass asks the nodes in mapping order, one message each
    assert [partition for partition, _ in results["flower"]] == [0, 2, 4, 5, 2]


def test_a_push_through_the_prompt_grid_wakes_the_extractor_and_counts_are_kept(
    monkeypatch,
) -> None:
    monkeypatch.setattr(prompt_engine, "TICK_S", 3600.0)  # only a push can wake it in time
    state, grid, mapping = federation()
    nodes = list(mapping)
    queue, stop, thread = run_extractor(prompt_add_messages_to_queue, state, mapping)
    try:
        assert undelivered_nodes(state) == {}
        prompt = PromptGrid(grid)
        prompt.push_messages(messages(grid, nodes[:3], "b"))
        got = drain(queue, 3)
        assert sorted(tags(got)) == sorted(f"b-{node}" for node in nodes[:3])
        assert undelivered_nodes(state) == {}  # all delivered, none asked for twice
        prompt.push_messages(messages(grid, [nodes[3], nodes[3]], "c"))  # two for one node
        assert tags(drain(queue, 2)) == [f"c-{nodes[3]}"] * 2
    finally:
        stop.set()
        PUSHED.set()  # the pause ends, the loop sees the stop
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_push_that_does_not_signal_is_seen_on_flowers_tick() -> None:
    state, grid, mapping = federation()
    nodes = list(mapping)
    queue, stop, thread = run_extractor(prompt_add_messages_to_queue, state, mapping)
    try:
        PUSHED.clear()
        grid.push_messages(messages(grid, nodes[:1], "d"))  # Flower's grid: no PUSHED
        assert tags(drain(queue, 1)) == [f"d-{nodes[0]}"]
    finally:
        stop.set()
        thread.join(timeout=5)


def test_the_prompt_injector_stores_each_reply_and_signals_it() -> None:
    state, grid, mapping = federation()
    nodes = list(mapping)
    ids = list(grid.push_messages(messages(grid, nodes[:2], "r")))
    stored = {m.metadata.message_id: m for m in state.get_message_ins(nodes[0], limit=None)}
    stored |= {m.metadata.message_id: m for m in state.get_message_ins(nodes[1], limit=None)}
    replies: Queue = Queue()
    stop = threading.Event()
    REPLIED.clear()
    thread = threading.Thread(
        target=prompt_put_message_into_state, args=(state, replies, stop), daemon=True
    )
    thread.start()
    try:
        for message_id in ids:
            reply = Message(RecordDict(), reply_to=stored[message_id])
            reply.metadata.__dict__["_message_id"] = f"reply-{message_id}"
            replies.put(reply)
        assert REPLIED.wait(10)
        pulled: list[Message] = []
        deadline = time.monotonic() + 10
        while len(pulled) < 2 and time.monotonic() < deadline:
            pulled += list(grid.pull_messages(ids))
            REPLIED.wait(0.05)
        assert sorted(m.metadata.reply_to_message_id for m in pulled) == sorted(ids)
    finally:
        stop.set()
        thread.join(timeout=5)


def test_install_replaces_only_the_known_flower_code(monkeypatch, capsys) -> None:
    flower_extractor = vce_api.add_messages_to_queue
    monkeypatch.setattr(vce_api, "add_messages_to_queue", flower_extractor)
    monkeypatch.setattr(vce_api, "put_message_into_state", vce_api.put_message_into_state)
    monkeypatch.setenv(prompt_engine.ENV_SWITCH, "0")
    assert not install()  # switched off
    assert vce_api.add_messages_to_queue is flower_extractor
    monkeypatch.delenv(prompt_engine.ENV_SWITCH)
    if flower_extractor is not prompt_add_messages_to_queue:  # this process may have it in
        monkeypatch.setattr(
            prompt_engine,
            "FLOWER_SOURCES",
            {name: set() for name in prompt_engine.FLOWER_SOURCES},
        )
        assert not install()  # code it does not know: Flower's stays, with a warning
        assert vce_api.add_messages_to_queue is flower_extractor
        assert "keeps Flower's 0.1 s hand-offs" in capsys.readouterr().err
        monkeypatch.undo()
        monkeypatch.setattr(vce_api, "add_messages_to_queue", flower_extractor)
        monkeypatch.setattr(vce_api, "put_message_into_state", vce_api.put_message_into_state)
    assert install()
    assert vce_api.add_messages_to_queue is prompt_add_messages_to_queue
    assert vce_api.put_message_into_state is prompt_put_message_into_state
    assert install()  # twice: still in place


def test_messages_for_nodes_outside_the_mapping_do_not_keep_it_busy(monkeypatch) -> None:
    """Undelivered messages the extractor never asks for (a node it does not serve) leave it
    pausing between passes, as Flower's does, not spinning."""
    state, grid, mapping = federation()
    nodes = list(mapping)
    grid.push_messages(messages(grid, [nodes[5], nodes[5]], "x"))  # two for the last node
    served = {node: mapping[node] for node in nodes[:5]}
    passes = []
    real = prompt_engine.undelivered_nodes

    def counting(state):  # noqa: ANN001, ANN202
        passes.append(1)
        return real(state)

    monkeypatch.setattr(prompt_engine, "undelivered_nodes", counting)
    queue, stop, thread = run_extractor(prompt_add_messages_to_queue, state, served)
    time.sleep(0.35)
    stop.set()
    thread.join(timeout=5)
    assert queue.empty()
    assert len(passes) <= 6  # a pass per 0.1 s tick, not a spin
