"""The warm worker (``client_apps.warm``): same replies as in-process, safe fallbacks, lifecycle.

A small run (2 clients, 2 rounds, pFedSeq with fused evaluation) goes through the real ServerApp
loop; every message is handled both in-process and by a warm worker, from copies of the same
context, and the replies and updated states are compared. The other tests reuse its messages.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto, recorddict_to_proto

from client_apps import warm
from client_apps.app import app
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.records import protocol as P
from fedfm_flower.records.durable import save_tensors
from fedfm_flower.simulation.processes import pid_alive
from server_apps.inprocess import InProcessGrid, simulation_node_configs
from server_apps.runner import run_experiment

READY_S = 120.0  # a loaded 2-core machine imports torch slowly


@dataclass
class Exchange:
    """One message, the context it was handled with, and the in-process outcome."""

    message: Message
    before: Context
    reply: Message
    state: RecordDict


def copy_context(context: Context) -> Context:
    """A deep copy, through the same serde the worker uses."""
    return context_from_proto(context_to_proto(context))


def comparable(content: RecordDict) -> dict:
    """A reply's records, bit-exact, without wall-clock timings (``*-seconds``)."""
    out: dict = {}
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            out[name] = recorddict_to_proto(RecordDict({name: record})).SerializeToString(
                deterministic=True
            )
        elif isinstance(record, MetricRecord):
            out[name] = {k: v for k, v in record.items() if not k.endswith("-seconds")}
        else:
            out[name] = dict(record)
    return out


def state_bytes(state: RecordDict) -> bytes:
    """A context state, serialized deterministically."""
    return recorddict_to_proto(state).SerializeToString(deterministic=True)


def in_process(message: Message, context: Context) -> Message:
    """The ClientApp in this process (pytest is no flwr-clientapp: the mod never forwards)."""
    return app(message, context)


def must_not_run(message: Message, context: Context) -> Message:
    """A ``call_next`` for calls that must be answered by the worker."""
    raise AssertionError("handled in-process, expected the warm worker")


def stop(*processes: subprocess.Popen[bytes], endpoint: warm.Endpoint | None = None) -> None:
    """Kill these workers (default: every worker this test process started); remove the files
    of ``endpoint``."""
    for process in processes or warm._spawned:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    for path in endpoint.files() if endpoint is not None else ():
        path.unlink(missing_ok=True)


def kill_and_reap(pid: int) -> None:
    """SIGKILL a worker this process started and wait until all its threads are gone (a
    killed process shows as a zombie while its other threads still hold its socket)."""
    os.kill(pid, signal.SIGKILL)
    (process,) = [p for p in warm._spawned if p.pid == pid]
    process.wait(timeout=10)


@dataclass
class Recorded:
    """The worker, and every message of the small run with both outcomes."""

    endpoint: warm.Endpoint
    exchanges: list[Exchange]
    forwarded: list[tuple[Message, RecordDict]]


@pytest.fixture(scope="module")
def recorded(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    """Run the small experiment with every message handled in-process and by a worker."""
    endpoint = warm.Endpoint.for_key(f"test-{uuid.uuid4().hex[:12]}")
    process = endpoint.spawn((os.getpid(),), idle_s=300, preload=False)
    sock = endpoint.wait_until_ready(process, READY_S)
    assert sock is not None, "the warm worker did not start"
    sock.close()
    exchanges: list[Exchange] = []
    forwarded: list[tuple[Message, RecordDict]] = []

    class Twin:
        def __call__(self, message: Message, context: Context) -> Message:
            before, shadow = copy_context(context), copy_context(context)
            reply = in_process(message, context)
            exchanges.append(Exchange(message, before, reply, copy_context(context).state))
            other = warm.forward(message, shadow, endpoint)
            assert other is not None, "the worker did not reply"
            forwarded.append((other, shadow.state))
            return reply

    output = tmp_path_factory.mktemp("warm-runs")
    full = {
        **ExperimentConfig().to_run_config(),
        "method": "pfedseq",
        "num-server-rounds": 2,
        "num-clients": 2,
        "cache-dir": str(cache_dir),
        "output-dir": str(output),
        "pretrain-epochs": 30,
        "seed": 0,
        "run-name": "warm",
    }
    grid = InProcessGrid(Twin(), full, simulation_node_configs(2))
    try:
        run_experiment(grid, ExperimentConfig.from_run_config(full))
        yield Recorded(endpoint, exchanges, forwarded)
    finally:
        stop(endpoint=endpoint)


def find(recorded: Recorded, kind: str, fused: bool | None = None) -> list[Exchange]:
    """The exchanges of one message type (train: fused or not)."""
    found = [e for e in recorded.exchanges if e.message.metadata.message_type == kind]
    if fused is not None:
        found = [e for e in found if (P.EVALUATE_ROUND in e.message.content[P.CONFIG]) == fused]
    return found


def test_worker_replies_equal_in_process_replies(recorded: Recorded) -> None:
    kinds = [e.message.metadata.message_type for e in recorded.exchanges]
    assert kinds.count("query") == 2 and kinds.count("evaluate") == 2
    assert len(find(recorded, "train", fused=False)) == 2  # round 1
    assert len(find(recorded, "train", fused=True)) == 2  # round 2 carries round 1's evaluation
    for exchange, (reply, state) in zip(recorded.exchanges, recorded.forwarded, strict=True):
        assert comparable(reply.content) == comparable(exchange.reply.content)
        assert reply.metadata.reply_to_message_id == exchange.message.metadata.message_id
        assert reply.metadata.message_type == exchange.message.metadata.message_type
        assert state_bytes(state) == state_bytes(exchange.state)  # written back, bit for bit
    fused = find(recorded, "train", fused=True)[0].reply.content
    assert P.EVALUATE_METRICS in fused and fused[P.METRICS][P.STATE_ROUND] == 1


def test_private_files_and_a_wrong_token_is_refused(
    recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = recorded.endpoint
    assert stat.S_IMODE(os.lstat(endpoint.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(endpoint.token_path).st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(endpoint.socket_path).st_mode) == 0o600
    assert len(str(endpoint.socket_path)) < 100
    assert warm.ping(endpoint) == warm.OK
    assert warm.ping(endpoint, token=b"0" * 64) == warm.REFUSED
    assert warm.ping(endpoint, token=b"") == warm.REFUSED
    # A requester still sending when the worker refuses gets the refusal: the worker reads the
    # rest of the request before it closes (it closed at once, so the requester's next send
    # broke the pipe and the refusal was lost; seen under load).
    send = warm.send_frames

    def slow_send(sock, *payloads):  # noqa: ANN001, ANN002, ANN202 - warm.send_frames' own
        for payload in payloads:
            send(sock, payload)
            time.sleep(0.3)

    monkeypatch.setattr(warm, "send_frames", slow_send)
    assert warm.ping(endpoint, token=b"1" * 64) == warm.REFUSED
    monkeypatch.setattr(warm, "send_frames", send)
    # A message forwarded with a wrong token is refused and handled in-process instead.
    exchange = find(recorded, "evaluate")[0]
    monkeypatch.setattr(warm.Endpoint, "token", lambda self: b"f" * 64)
    assert warm.forward(exchange.message, copy_context(exchange.before), endpoint) is None


def test_a_second_concurrent_request_is_answered_busy(recorded: Recorded) -> None:
    endpoint = recorded.endpoint
    first = endpoint.connect()
    assert first is not None
    with first:
        warm.send_frames(first, endpoint.token(), warm.RUN)
        assert warm.recv_frame(first, warm.SMALL_FRAME) == warm.GO  # the worker is now taken
        exchange = find(recorded, "evaluate")[0]
        context = copy_context(exchange.before)
        reply = warm.handle(exchange.message, context, in_process, endpoint, None)
        assert comparable(reply.content) == comparable(exchange.reply.content)
    # The first connection closed without a request: the worker is free again.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        context = copy_context(exchange.before)
        if warm.forward(exchange.message, context, endpoint) is not None:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the worker stayed busy")


def test_the_next_message_finds_the_worker_free_once_the_reply_is_read(
    recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ClientApp that has read its reply may send the node's next message at once; the worker
    must not answer it busy while it finishes the last one, however slowly (on a loaded machine
    its thread may stall right after sending: the next message then went to a cold process)."""
    from client_apps import warm_worker

    send = warm_worker.send_frames

    def send_then_stall(conn, *payloads: bytes) -> None:
        send(conn, *payloads)
        if payloads[:1] == (warm.OK,):
            time.sleep(0.5)

    monkeypatch.setattr(warm_worker, "send_frames", send_then_stall)
    directory = Path(tempfile.mkdtemp(prefix="fedfm-warm-test-"))  # a short socket path
    worker = warm_worker.Worker(warm.Endpoint(directory, "next"), idle_s=2.0)
    worker.bind()
    serving = threading.Thread(target=worker.serve, daemon=True)
    serving.start()
    try:
        exchange = find(recorded, "query")[0]
        for _ in range(3):
            context = copy_context(exchange.before)
            reply = warm.forward(exchange.message, context, worker.endpoint)
            assert reply is not None, "the worker answered busy, or not at all"
            assert comparable(reply.content) == comparable(exchange.reply.content)
    finally:
        worker.close()
        serving.join(timeout=30)
        shutil.rmtree(directory, ignore_errors=True)
    assert not serving.is_alive()


def test_a_killed_worker_falls_back_in_process_and_is_replaced(
    recorded: Recorded, tmp_path: Path
) -> None:
    endpoint = recorded.endpoint
    spawn = warm.SpawnSpec((os.getpid(),), idle_s=300, preload=False)
    first = endpoint.worker_pid()
    assert first is not None and pid_alive(first)
    # Round 2's fused training message; its context mirrors state to a state-dir where the
    # killed worker had already written round 2's state (other values than the real ones).
    exchange = find(recorded, "train", fused=True)[0]
    context = copy_context(exchange.before)
    context.node_config["state-dir"] = str(tmp_path / "state")
    client = exchange.reply.content[P.METRICS][P.CLIENT_ID]
    run_name = exchange.message.content[P.CONFIG][P.RUN_NAME]
    written = (
        tmp_path / "state" / str(run_name) / f"client_{int(client)}" / "round_00002.safetensors"
    )
    personal = exchange.state.array_records[f"personal.r{2}"].to_torch_state_dict()
    save_tensors(written, {k: torch.full_like(v, 7.0) for k, v in personal.items()})

    # SIGKILL mid-message: the dropped connection sends the message to the in-process handler,
    # which starts from the same state as the first attempt (the round-2 file is ignored).
    reply = warm.handle(
        exchange.message,
        context,
        in_process,
        endpoint,
        spawn,
        on_sent=lambda: kill_and_reap(first),
    )
    assert comparable(reply.content) == comparable(exchange.reply.content)
    assert state_bytes(context.state) == state_bytes(exchange.state)

    # The next message finds the stale socket, starts a new worker and is answered by it.
    second_exchange = find(recorded, "train", fused=True)[1]
    context = copy_context(second_exchange.before)
    reply = warm.handle(second_exchange.message, context, must_not_run, endpoint, spawn)
    second = endpoint.worker_pid()
    assert second is not None and second != first and pid_alive(second)
    assert comparable(reply.content) == comparable(second_exchange.reply.content)
    assert state_bytes(context.state) == state_bytes(second_exchange.state)

    # SIGKILL between messages: the next message is done in-process (here without waiting for
    # the worker it starts), with the same reply, and a third worker comes up.
    kill_and_reap(second)
    context = copy_context(exchange.before)
    reply = warm.handle(exchange.message, context, in_process, endpoint, spawn, wait_s=0)
    assert comparable(reply.content) == comparable(exchange.reply.content)
    assert endpoint.wait_until_ready(warm._spawned[-1], READY_S) is not None
    third = endpoint.worker_pid()
    assert third not in (None, first, second) and warm.ping(endpoint) == warm.OK


def test_the_worker_exits_when_a_watched_process_dies_or_when_idle() -> None:
    sleeper = subprocess.Popen(["sleep", "120"])
    endpoint = warm.Endpoint.for_key(f"test-{uuid.uuid4().hex[:12]}")
    worker = endpoint.spawn((sleeper.pid,), idle_s=300, preload=False)
    try:
        connection = endpoint.wait_until_ready(worker, READY_S)
        assert connection is not None
        connection.close()
        sleeper.kill()  # the SuperNode dies
        assert worker.wait(timeout=10) == 0
        assert not any(path.exists() for path in endpoint.files())
    finally:
        sleeper.kill()
        sleeper.wait()
        stop(worker, endpoint=endpoint)
    # A worker killed long ago left its files; the next worker to start removes them.
    stale = warm.Endpoint.for_key(f"test-{uuid.uuid4().hex[:12]}")
    for path in stale.files():
        path.write_text("1\n")
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    idle = warm.Endpoint.for_key(f"test-{uuid.uuid4().hex[:12]}")
    worker = idle.spawn((os.getpid(),), idle_s=0.5, preload=False)
    try:
        assert worker.wait(timeout=30) == 0
        assert not any(path.exists() for path in idle.files())
        assert not any(path.exists() for path in stale.files())
    finally:
        stop(worker, endpoint=idle)


def test_a_second_worker_for_the_same_endpoint_steps_aside(recorded: Recorded) -> None:
    endpoint = recorded.endpoint
    before = endpoint.worker_pid()
    assert warm.ping(endpoint) == warm.OK
    extra = endpoint.spawn((os.getpid(),), idle_s=300, preload=False)
    assert extra.wait(timeout=30) == 0  # the lock is taken: it exits at once
    assert endpoint.worker_pid() == before and warm.ping(endpoint) == warm.OK


@pytest.mark.parametrize(
    ("node_config", "key", "value"),
    [
        ({"warm-worker": "yes"}, "warm-worker", "'yes'"),
        ({"warm-worker": 1}, "warm-worker", "1"),
        ({"warm-worker-idle-s": 0}, "warm-worker-idle-s", "0"),
        ({"warm-worker-idle-s": "soon"}, "warm-worker-idle-s", "'soon'"),
    ],
)
def test_a_bad_node_config_value_is_refused(node_config: dict, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as error:
        warm.WarmWorkerSettings.from_node_config(node_config)
    assert str(error.value).startswith(f"node config '{key}' = {value} is invalid")
    assert warm.WarmWorkerSettings.from_node_config({}) == warm.WarmWorkerSettings(True, 900.0)
    parsed = warm.WarmWorkerSettings.from_node_config({"warm-worker": "False"})
    assert parsed.enabled is False


def test_the_clientapp_refuses_a_bad_value_and_forwards_only_in_flwr_clientapp(
    recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    exchange = find(recorded, "evaluate")[0]
    bad = copy_context(exchange.before)
    bad.node_config["warm-worker"] = "sometimes"
    with pytest.raises(ConfigError, match="node config 'warm-worker' = 'sometimes'"):
        app(exchange.message, bad)

    def no_forwarding(*args: object, **kwargs: object) -> None:
        raise AssertionError("forwarded")

    monkeypatch.setattr(warm, "forward", no_forwarding)
    assert not warm.in_clientapp_process()  # pytest, like a Ray actor, is no flwr-clientapp
    reply = app(exchange.message, copy_context(exchange.before))
    assert comparable(reply.content) == comparable(exchange.reply.content)
    monkeypatch.setattr(warm, "in_clientapp_process", lambda: True)
    off = copy_context(exchange.before)
    off.node_config["warm-worker"] = False
    reply = app(exchange.message, off)
    assert comparable(reply.content) == comparable(exchange.reply.content)


def test_a_refused_query_starts_no_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose query is refused (its partition-id out of range) gets no warm worker; an
    answered query starts one."""
    from types import SimpleNamespace

    started: list[warm.SpawnSpec] = []
    monkeypatch.setattr(warm, "ensure_worker", lambda endpoint, spawn: started.append(spawn))
    endpoint = warm.Endpoint.for_key(f"test-{uuid.uuid4().hex[:12]}")
    spawn = warm.SpawnSpec((os.getpid(),), idle_s=1, preload=False)
    query = SimpleNamespace(metadata=SimpleNamespace(message_type="query"))

    def reply(error: bool) -> SimpleNamespace:
        return SimpleNamespace(has_error=lambda: error)

    def raises(message: Message, context: Context) -> Message:
        raise ValueError("node config 'partition-id' = 9 is invalid")

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    assert warm.handle(query, context, lambda m, c: reply(True), endpoint, spawn).has_error()
    with pytest.raises(ValueError, match="partition-id"):
        warm.handle(query, context, raises, endpoint, spawn)
    assert started == []
    assert not warm.handle(query, context, lambda m, c: reply(False), endpoint, spawn).has_error()
    assert started == [spawn]
