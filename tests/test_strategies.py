"""Strategy logic without any model: aggregation, per-node messages, reply validation, state."""

from __future__ import annotations

import hashlib
import math
import time

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from client_apps.faults import FAULT_KINDS, InjectedCrash, inject_fault, parse_faults
from fedfm_flower.config.experiment import ConfigError, ExperimentConfig
from fedfm_flower.learners.aggregation import weighted_average
from fedfm_flower.methods.halves import strategy_class
from fedfm_flower.models import TrainableTensors
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import from_array_record, record_names, to_array_record
from server_apps.inprocess import InProcessGrid, identity_app
from strategies.fedavg import FedAvgStrategy
from strategies.parts.context import RunContext
from strategies.parts.sampling import ClientSampler

INITIAL = TrainableTensors(
    {
        "backbone.blocks.0.attn.qkv.lora_A.default.weight": torch.randn(2, 8),
        "backbone.blocks.0.attn.qkv.lora_B.default.weight": torch.zeros(24, 2),
        "head.weight": torch.randn(3, 8),
        "head.bias": torch.zeros(3),
    },
    {
        "backbone.blocks.0.attn.qkv.lora_A.default.weight": "adapter",
        "backbone.blocks.0.attn.qkv.lora_B.default.weight": "adapter",
        "head.weight": "head",
        "head.bias": "head",
    },
)


def make_strategy(method: str = "fedavg", num_clients: int = 3):
    config = ExperimentConfig(method=method, num_clients=num_clients)
    strategy = strategy_class(method)(config, INITIAL)
    grid = InProcessGrid(
        identity_app(), config.to_run_config(), [{"client-id": 10 + i} for i in range(num_clients)]
    )
    return strategy, grid


def reply_to(
    message: Message, arrays: dict | ArrayRecord, num_examples: int, client_id: int | None = None
) -> Message:
    record = arrays if isinstance(arrays, ArrayRecord) else to_array_record(arrays)
    cid = client_id if client_id is not None else int(message.content[P.CONFIG][P.CLIENT_ID])
    metrics = MetricRecord({P.CLIENT_ID: cid, P.NUM_EXAMPLES: num_examples, P.TRAIN_LOSS: 1.0})
    return Message(RecordDict({P.ARRAYS: record, P.METRICS: metrics}), reply_to=message)


def state_hash(strategy) -> str:
    tensors, _ = strategy.state_dict()
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + tensors[name].numpy().tobytes())
    return digest.hexdigest()


def test_weighted_average_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(4, 5)).astype(np.float32) for _ in range(3)]
    ws = [10.0, 30.0, 60.0]
    got = weighted_average([{"x": torch.from_numpy(x)} for x in xs], ws)["x"].numpy()
    expected = sum(w * x.astype(np.float64) for w, x in zip(ws, xs, strict=True)) / sum(ws)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_node_mapping_is_learned_by_query_and_messages_are_per_node() -> None:
    strategy, grid = make_strategy("fedrep")
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    assert strategy.clients() == [10, 11, 12]
    assert len({id(m.content) for m in messages}) == len(messages)
    for message in messages:
        assert strategy.nodes.client_of(message.metadata.dst_node_id) == int(
            message.content[P.CONFIG][P.CLIENT_ID]
        )
        keys = set(record_names(message.content[P.ARRAYS]))
        # FedRep sends the adapter only: no head, no frozen backbone tensor.
        assert keys == {k for k in INITIAL.tensors if "lora_" in k}


def test_local_sends_nothing() -> None:
    strategy, grid = make_strategy("local")
    for message in strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid):
        assert not record_names(message.content[P.ARRAYS])


def test_duplicate_client_ids_are_reported_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    config = ExperimentConfig()
    strategy = FedAvgStrategy(config, INITIAL)
    grid = InProcessGrid(
        identity_app(),
        config.to_run_config(),
        [{"client-id": 1}, {"client-id": 1}, {"client-id": 2}],
    )
    strategy.learn_node_mapping(grid, 1)
    assert strategy.clients() == [1, 2]
    assert "two nodes claim client-id 1" in caplog.text
    holder, duplicate = 1001, 1002  # InProcessGrid numbers nodes from 1001 in order
    assert strategy.nodes.client_of(holder) == 1 and duplicate in strategy.nodes.refused_nodes
    # The refused duplicate is not queried again every round...
    caplog.clear()
    queried = len(grid.sent)
    strategy.learn_node_mapping(grid, 2)
    assert len(grid.sent) == queried and "two nodes claim" not in caplog.text
    # ...but once the holder leaves, it is asked again and takes the client id over.
    grid.offline.add(holder)
    strategy.learn_node_mapping(grid, 3)
    assert strategy.nodes.node_to_client == {duplicate: 1, 1003: 2}


def test_unanswered_message_counts_as_missing_not_rejected(caplog) -> None:
    """The SuperLink's NODE_UNAVAILABLE reply (sent from the SuperLink's own node id) for a node
    whose heartbeat stopped mid-round: the client is missing, the round goes on."""
    strategy, grid = make_strategy()
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    good = {k: torch.ones_like(v) for k, v in INITIAL.tensors.items()}
    replies = [reply_to(m, good, 10) for m in messages[:-1]]
    lost = Message(
        Error(code=ErrorCode.NODE_UNAVAILABLE, reason="no heartbeat"), reply_to=messages[-1]
    )
    lost.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
    report = strategy.aggregate_round(1, None, [*replies, lost]).train.report
    lost_client = strategy.nodes.client_of(messages[-1].metadata.dst_node_id)
    assert report.missing == [lost_client]
    assert report.rejected == {}
    assert len(report.accepted) == len(messages) - 1
    assert "rejected" not in caplog.text


@pytest.mark.parametrize("kind", [k for k in FAULT_KINDS if k != "crash"])
def test_every_injectable_fault_is_rejected_without_state_change(kind: str, caplog) -> None:
    """What a SuperNode with ``inject-fault`` sends in the deployment tests is refused here."""
    strategy, grid = make_strategy()
    before = state_hash(strategy)
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    good = {k: torch.ones_like(v) for k, v in INITIAL.tensors.items()}
    replies = [reply_to(m, good, 10) for m in messages]
    for reply in replies:
        inject_fault(reply.content, kind)
    report = strategy.aggregate_round(1, None, replies).train.report
    assert report.accepted == {}
    assert sorted(report.rejected) == sorted(str(c) for c in report.sent)
    assert state_hash(strategy) == before
    assert caplog.text.count("rejected reply") == len(messages)


def test_fault_injection_config_is_parsed_and_checked() -> None:
    assert parse_faults({}) == {}
    assert parse_faults({"inject-fault": "2:nan, 5:oversize"}) == {2: "nan", 5: "oversize"}
    with pytest.raises(ConfigError, match="node config 'inject-fault' = '2:melt'"):
        parse_faults({"inject-fault": "2:melt"})
    with pytest.raises(InjectedCrash):
        inject_fault(RecordDict(), "crash")


def test_a_held_training_waits_for_its_release_file(tmp_path) -> None:
    import threading

    from client_apps.faults import RELEASE_FILE, hold_until_released

    assert parse_faults({"inject-fault": "2:hold"}) == {2: "hold"}
    timer = threading.Timer(0.3, (tmp_path / RELEASE_FILE).touch)
    timer.start()
    started = time.monotonic()
    hold_until_released(tmp_path, seconds=30)
    assert 0.25 <= time.monotonic() - started < 10
    with pytest.raises(ConfigError, match="needs a client-state-dir"):
        hold_until_released(None)


def test_fedavg_aggregates_with_example_weights() -> None:
    strategy, grid = make_strategy()
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    updates = [
        {k: torch.full_like(v, float(i + 1)) for k, v in INITIAL.tensors.items()}
        for i in range(len(messages))
    ]
    counts = [10, 20, 70]
    replies = [reply_to(m, u, n) for m, u, n in zip(messages, updates, counts, strict=True)]
    strategy.aggregate_train(1, replies)
    expected = (1 * 10 + 2 * 20 + 3 * 70) / 100
    for tensor in strategy.global_tensors.values():
        torch.testing.assert_close(tensor, torch.full_like(tensor, expected))


def _corrupt(kind: str, arrays: dict) -> ArrayRecord | dict:
    name = next(iter(arrays))
    bad = dict(arrays)
    if kind == "nan":
        bad[name] = torch.full_like(arrays[name], float("nan"))
    elif kind == "inf":
        bad[name] = torch.full_like(arrays[name], float("inf"))
    elif kind == "shape":
        bad[name] = torch.zeros(arrays[name].shape[0] + 1, *arrays[name].shape[1:])
    elif kind == "dtype":
        bad[name] = arrays[name].double()
    elif kind == "missing":
        bad.pop(name)
    elif kind == "extra":
        bad["backbone.blocks.0.attn.qkv.weight"] = torch.zeros(24, 8)
    elif kind == "oversized":
        record = to_array_record(arrays)
        array = record[name]
        record[name] = Array(
            dtype=array.dtype,
            shape=array.shape,
            stype=array.stype,
            data=array.data + b"\0" * 10_000_000,
        )
        return record
    return bad


@pytest.mark.parametrize(
    "kind",
    [
        "nan",
        "inf",
        "shape",
        "dtype",
        "missing",
        "extra",
        "oversized",
        "foreign-id",
        "error",
        "no-metrics",
    ],
)
def test_bad_reply_is_dropped_and_round_completes(kind: str, caplog) -> None:
    strategy, grid = make_strategy()
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    good = {k: torch.ones_like(v) for k, v in INITIAL.tensors.items()}
    replies = [reply_to(m, good, 10) for m in messages[:-1]]
    last = messages[-1]
    if kind == "foreign-id":
        replies.append(reply_to(last, good, 10, client_id=99))
    elif kind == "error":
        replies.append(Message(Error(code=1, reason="boom"), reply_to=last))
    elif kind == "no-metrics":
        replies.append(Message(RecordDict({P.ARRAYS: to_array_record(good)}), reply_to=last))
    else:
        replies.append(reply_to(last, _corrupt(kind, good), 10))
    outcome = strategy.aggregate_round(1, None, replies)
    bad_client = strategy.nodes.client_of(last.metadata.dst_node_id)
    assert str(bad_client) in outcome.train.report.rejected
    assert bad_client not in outcome.train.report.accepted
    assert outcome.train.metrics["num-clients"] == len(messages) - 1
    assert outcome.evaluation is None
    # the good replies all sent ones: each update is ones - the initial shared tensors
    update = sum(float((torch.ones_like(v) - v).pow(2).sum()) for v in INITIAL.tensors.values())
    assert outcome.server_metrics == {"update-norm-median": pytest.approx(math.sqrt(update))}
    for tensor in strategy.global_tensors.values():  # only the good replies were averaged
        torch.testing.assert_close(tensor, torch.ones_like(tensor))
    assert "rejected reply" in caplog.text


@pytest.mark.parametrize("kind", ["nan", "shape", "extra", "foreign-id"])
def test_all_bad_replies_leave_state_unchanged(kind: str) -> None:
    strategy, grid = make_strategy()
    before = state_hash(strategy)
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    good = {k: torch.ones_like(v) for k, v in INITIAL.tensors.items()}
    if kind == "foreign-id":
        replies = [reply_to(m, good, 10, client_id=99) for m in messages]
    else:
        replies = [reply_to(m, _corrupt(kind, good), 10) for m in messages]
    strategy.aggregate_train(1, replies)
    assert state_hash(strategy) == before


def test_state_dict_round_trip_is_exact() -> None:
    strategy, grid = make_strategy("fedrep")
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    strategy.aggregate_train(
        1,
        [
            reply_to(
                m,
                {k: torch.randn_like(v) for k, v in from_array_record(m.content[P.ARRAYS]).items()},
                5,
            )
            for m in messages
        ],
    )
    tensors, meta = strategy.state_dict()
    fresh, _ = make_strategy("fedrep")
    fresh.load_state_dict(tensors, meta)
    assert state_hash(fresh) == state_hash(strategy)
    with pytest.raises(ValueError, match="fedrep"):
        make_strategy("fedavg")[0].load_state_dict(tensors, meta)


def test_sampling_is_seeded_and_respects_fraction() -> None:
    sampler = ClientSampler(ExperimentConfig(fraction_train=0.5), {})
    clients = list(range(10))
    first = sampler.sample(clients, 3, 0.5)
    assert len(first) == 5
    assert sampler.sample(clients, 3, 0.5) == first
    assert any(sampler.sample(clients, r, 0.5) != first for r in range(4, 10))
    assert sampler.sample(clients, 3, 0.5, salt=1) != first  # evaluation draws apart


def test_checkpoints_name_their_method_and_older_ones_their_strategy_class() -> None:
    strategy, _ = make_strategy("fedrep")
    tensors, meta = strategy.state_dict()
    assert meta == {"strategy": "FedAvgStrategy", "method": "fedrep"}
    with pytest.raises(ValueError, match="fedrep state, not fedavg"):
        make_strategy("fedavg")[0].load_state_dict(tensors, meta)
    # A checkpoint from before methods were named: the strategy class decides.
    make_strategy("fedrep")[0].load_state_dict(tensors, {"strategy": "FedAvgStrategy"})
    with pytest.raises(ValueError, match="PFedSeqStrategy state, not FedAvgStrategy"):
        make_strategy("fedrep")[0].load_state_dict(tensors, {"strategy": "PFedSeqStrategy"})


def test_run_facts_come_with_the_constructor_and_reach_every_message() -> None:
    config = ExperimentConfig(num_clients=3)
    context = RunContext(run_name="facts", client_holdings={10: ("image",)})
    strategy = FedAvgStrategy(config, INITIAL, context)
    grid = InProcessGrid(
        identity_app(), config.to_run_config(), [{"client-id": 10 + i} for i in range(3)]
    )
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    assert {m.content[P.CONFIG][P.RUN_NAME] for m in messages} == {"facts"}
    assert {
        m.content[P.CONFIG][P.RUN_NAME] for m in grid.sent if m.metadata.message_type == "query"
    } == {"facts"}
    assert strategy.nodes.holdings_of(10) == ("image",) and strategy.nodes.holdings_of(11) == ()
    with pytest.raises(TypeError):
        context.client_tasks[1] = "task"  # type: ignore[index]  # read-only


def test_a_fused_round_returns_both_phases_outcomes() -> None:
    """Round 2's training carries round 1's evaluation: the evaluators that train evaluate on
    their training message, the one that does not gets an evaluate message; each part of the
    replies lands in its own phase's report."""
    config = ExperimentConfig(num_clients=3, fraction_train=0.5, fraction_evaluate=1.0)
    strategy = FedAvgStrategy(config, INITIAL)
    grid = InProcessGrid(
        identity_app(), config.to_run_config(), [{"client-id": 10 + i} for i in range(3)]
    )
    messages = strategy.configure_round(2, 1, grid)
    training = [m for m in messages if m.metadata.message_type == "train"]
    alone = [m for m in messages if m.metadata.message_type == "evaluate"]
    assert len(training) == 2 and len(alone) == 1
    assert all(m.content[P.CONFIG][P.EVALUATE_ROUND] == 1 for m in training)
    assert alone[0].content[P.CONFIG][P.SERVER_ROUND] == 1
    replies = []
    for message in training:
        sent = from_array_record(message.content[P.ARRAYS])
        reply = reply_to(message, {k: torch.ones_like(v) for k, v in sent.items()}, 10)
        cid = int(message.content[P.CONFIG][P.CLIENT_ID])
        reply.content[P.EVALUATE_METRICS] = MetricRecord(
            {P.CLIENT_ID: cid, P.NUM_EXAMPLES: 5, "test-accuracy": 0.5}
        )
        replies.append(reply)
    cid = int(alone[0].content[P.CONFIG][P.CLIENT_ID])
    replies.append(
        Message(
            RecordDict(
                {
                    P.METRICS: MetricRecord(
                        {P.CLIENT_ID: cid, P.NUM_EXAMPLES: 5, "test-accuracy": 1.0}
                    )
                }
            ),
            reply_to=alone[0],
        )
    )
    outcome = strategy.aggregate_round(2, 1, replies)
    trainers = sorted(int(m.content[P.CONFIG][P.CLIENT_ID]) for m in training)
    assert (
        outcome.train.report.sent == trainers and sorted(outcome.train.report.accepted) == trainers
    )
    assert outcome.train.metrics is not None and outcome.train.metrics["num-clients"] == 2
    assert set(outcome.server_metrics) == {"update-norm-median"}  # FedAvg's only server metric
    assert outcome.evaluation is not None
    assert sorted(outcome.evaluation.report.accepted) == [10, 11, 12]
    assert outcome.evaluation.metrics["test-accuracy-mean"] == pytest.approx(2 / 3)
    # A phase of its own: configure_evaluate, then aggregate_evaluation's PhaseOutcome.
    evaluate = list(strategy.configure_evaluate(2, ArrayRecord(), ConfigRecord(), grid))
    phase = strategy.aggregate_evaluation(2, [reply_to(m, {}, 3) for m in evaluate])
    assert phase.report.sent == [10, 11, 12] and phase.report.missing == []
    assert phase.metrics is not None and phase.metrics["num-clients"] == 3


# Regressions found by the property-based tests (tests/test_properties_replies.py): each of these
# replies crashed aggregate_round or was accepted.
ODD_METRICS = {
    "list-metric": ({"train-loss": [1.0, 2.0]}, "metric 'train-loss' is a list, not a number"),
    "huge-int-metric": ({"train-loss": 10**400}, "metric 'train-loss' = 1000"),
    "nan-client-id": ({P.CLIENT_ID: float("nan")}, "claims client-id nan"),
    "inf-client-id": ({P.CLIENT_ID: float("inf")}, "claims client-id inf"),
    "list-client-id": ({P.CLIENT_ID: [10]}, "claims client-id [10]"),
    "float-client-id": ({P.CLIENT_ID: 12.0}, "claims client-id 12.0"),
    "int64-overflow-examples": ({P.NUM_EXAMPLES: 2**63}, "bad num-examples 9223372036854775808"),
}


@pytest.mark.parametrize("kind", sorted(ODD_METRICS))
def test_odd_metric_values_are_rejected_not_crashing(kind: str) -> None:
    strategy, grid = make_strategy()
    before = state_hash(strategy)
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    good = {k: torch.ones_like(v) for k, v in INITIAL.tensors.items()}
    bad = reply_to(messages[-1], good, 10)
    changes, reason = ODD_METRICS[kind]
    if kind == "float-client-id":  # the client's own id, as a float
        changes = {P.CLIENT_ID: float(strategy.nodes.client_of(messages[-1].metadata.dst_node_id))}
    metrics = {**dict(bad.content[P.METRICS]), **changes}
    bad.content.metric_records[P.METRICS] = MetricRecord(metrics)
    report = strategy.aggregate_round(1, None, [bad]).train.report
    (client,) = report.rejected
    assert reason in report.rejected[client] and report.accepted == {}
    assert state_hash(strategy) == before


def test_a_second_reply_from_one_client_rejects_both() -> None:
    """Two replies from one node in one phase (a replay): neither counts, whatever the order,
    so the client is not weighed twice."""
    strategy, grid = make_strategy()
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    good = {k: torch.ones_like(v) for k, v in INITIAL.tensors.items()}
    twice = messages[0]
    replies = [reply_to(m, good, 10) for m in messages] + [reply_to(twice, good, 90)]
    report = strategy.aggregate_round(1, None, replies).train.report
    client = strategy.nodes.client_of(twice.metadata.dst_node_id)
    reason = f"2 replies from client {client} in one phase; none counts"
    assert report.rejected == {str(client): reason}
    assert sorted(report.accepted) == sorted(c for c in report.sent if c != client)
    assert report.missing == []


def test_an_array_whose_bytes_hold_another_shape_than_it_declares_is_rejected() -> None:
    strategy, grid = make_strategy()
    before = state_hash(strategy)
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    good = {k: torch.ones_like(v) for k, v in INITIAL.tensors.items()}
    record = to_array_record(good)
    name = "head.bias"
    lying = to_array_record({name: torch.ones(5)})[name]  # the bytes of a (5,) array
    record[name] = Array(dtype="float32", shape=(3,), stype=lying.stype, data=lying.data)
    report = strategy.aggregate_round(1, None, [reply_to(messages[0], record, 10)]).train.report
    (reason,) = report.rejected.values()
    assert reason == (
        "'head.bias' holds an array of shape (5,) and dtype float32, not the (3,) float32 it "
        "declares"
    )
    assert state_hash(strategy) == before


def test_the_mean_of_metrics_near_the_float_range_does_not_overflow() -> None:
    from strategies.parts.outcome import mean_metrics

    metrics = mean_metrics({1: {"x": 1.7e308}, 2: {"x": 1.7e308}, 3: {"x": -1.0}})
    assert metrics is not None and math.isfinite(metrics["x-mean"])
    assert metrics["x-mean"] == pytest.approx(1.7e308 / 3 * 2)


@pytest.mark.parametrize("client_id", [float("nan"), 1.5, [1]])
def test_an_identity_reply_with_an_odd_client_id_leaves_the_node_out(client_id, caplog) -> None:
    from strategies.parts.nodes import NodeDirectory

    class Grid:
        def get_node_ids(self) -> list[int]:
            return [7]

        def send_and_receive(self, messages, timeout=None):  # noqa: ANN001, ANN202
            metrics = MetricRecord({P.CLIENT_ID: client_id, P.NUM_PARTITIONS: float("nan")})
            return [Message(RecordDict({P.METRICS: metrics}), reply_to=m) for m in messages]

    InProcessGrid(identity_app(), {}, [])  # the server's identity, which messages read
    nodes = NodeDirectory("run", {})
    nodes.learn(Grid(), 1, lambda c: None)
    assert nodes.node_to_client == {} and nodes.num_partitions == 0
    assert "without an integer client-id" in caplog.text


def test_what_a_client_holds_and_its_task_are_looked_up_by_its_partition() -> None:
    """A deployment whose client ids are not its partition ids: the task's per-client facts are
    keyed by partition, so client 7 (partition 0) holds partition 0's pairs and is grouped
    with partition 0's task when sampling per task."""
    config = ExperimentConfig(method="fedavg", num_clients=2, sample_per_task=True)
    context = RunContext(
        run_name="ids",
        client_tasks={0: "image", 1: "text"},
        client_holdings={0: ("image-cls",), 1: ("text-gen",)},
    )
    initial = TrainableTensors({"w": torch.zeros(2)}, {"w": "adapter"})
    strategy = FedAvgStrategy(config, initial, context)
    nodes = [{"client-id": 7, "partition-id": 0}, {"client-id": 3, "partition-id": 1}]
    grid = InProcessGrid(identity_app(), config.to_run_config(), nodes)
    strategy.learn_node_mapping(grid, 1)
    assert strategy.nodes.holdings_of(7) == ("image-cls",)
    assert strategy.nodes.holdings_of(3) == ("text-gen",)
    assert strategy.nodes.data_key(7) == 0 and strategy.nodes.data_key(99) == 99
    # one client of each task, whatever the fraction: both tasks are drawn
    assert strategy.sampler.sample([3, 7], 1, 0.1) == [3, 7]
