"""SecAgg+: the server's mean equals the plain weighted mean within the quantization error, the
updates never travel in the clear, dropped clients are unmasked, refusals name the reason."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from run_configs import method_base
from tiny_strategy import TINY_SPLITS, tiny_strategy

from client_apps.secagg import secagg_mod
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.registry import METHODS
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.privacy.secagg import (
    SecAggSettings,
    SecureMean,
    SecureRound,
    secure_exchange,
)
from fedfm_flower.privacy.support import secagg_refusal
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import from_array_record, numpy_arrays, to_array_record
from server_apps.inprocess import InProcessGrid

SETTINGS = SecAggSettings(
    num_shares=1.0, threshold=0.5, clipping_range=1.0, quantization_range=2**22, max_weight=100.0
)


def received_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"adapter.a": torch.randn(5, 4, generator=g), "adapter.b": torch.randn(9, generator=g)}


class FixedUpdates:
    """A ClientApp stand-in: client i replies received + its update (seeded), weight 10 (i + 1);
    ``failing`` clients raise in training."""

    def __init__(self, failing: frozenset[int] = frozenset()) -> None:
        self.failing = failing
        self.sent_up: dict[int, dict[str, torch.Tensor]] = {}  # what each client trained

    def update(self, client_id: int, received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + client_id)
        return {n: 0.3 * torch.randn(t.shape, generator=g) for n, t in received.items()}

    def __call__(self, message: Message, context: Context) -> Message:
        client_id = int(context.node_config["partition-id"])
        if client_id in self.failing:
            raise RuntimeError(f"client {client_id} crashed mid-training")
        received = from_array_record(message.content[P.ARRAYS])
        trained = {n: t + self.update(client_id, received)[n] for n, t in received.items()}
        self.sent_up[client_id] = trained
        metrics = MetricRecord({P.CLIENT_ID: client_id, P.NUM_EXAMPLES: 10 * (client_id + 1)})
        content = RecordDict({P.ARRAYS: to_array_record(trained), P.METRICS: metrics})
        return Message(content, reply_to=message)


def unpack(outcome: SecureRound) -> tuple[list[Message], SecureMean | None]:
    return outcome.replies, outcome.mean


def with_mod(inner: FixedUpdates):  # noqa: ANN201
    def app(message: Message, context: Context) -> Message:
        return secagg_mod(message, context, inner)

    return app


def training_messages(clients: int) -> list[Message]:
    payload = received_tensors()
    return [
        Message(
            RecordDict(
                {
                    P.ARRAYS: to_array_record(payload),
                    P.CONFIG: ConfigRecord({P.CLIENT_ID: c, P.SERVER_ROUND: 1}),
                }
            ),
            dst_node_id=1001 + c,
            message_type=MessageType.TRAIN,
            group_id="1",
        )
        for c in range(clients)
    ]


def plain_mean(inner: FixedUpdates, clients: list[int], weighting: str) -> dict[str, np.ndarray]:
    received = received_tensors()
    weights = [1.0 if weighting == "uniform" else 10.0 * (c + 1) for c in clients]
    return {
        n: sum(
            w * (inner.sent_up[c][n] - received[n]).double().numpy()
            for w, c in zip(weights, clients, strict=True)
        )
        / sum(weights)
        for n in received
    }


def quantization_bound(clients: list[int], weighting: str) -> float:
    """Each client's w/W * update is rounded to a step of 2 range / levels (stochastically,
    so by less than one step); the mean divides the sum of k such errors by sum(w/W)."""
    step = 2 * SETTINGS.clipping_range / SETTINGS.quantization_range
    weights = [SETTINGS.max_weight if weighting == "uniform" else 10.0 * (c + 1) for c in clients]
    ratio = sum(w / SETTINGS.max_weight for w in weights)
    # the weights themselves are rounded to 1/levels: a relative error of ~k / (levels * ratio)
    return (len(clients) * step + 1e-6) / ratio


@pytest.mark.parametrize("weighting", ["examples", "uniform"])
def test_secure_mean_equals_the_plain_weighted_mean_and_no_update_travels(weighting: str) -> None:
    """5 clients through Flower's client mod and our server driver: the unmasked mean is the
    weighted mean of the updates within the quantization error, and no reply holds an array."""
    inner = FixedUpdates()
    grid = InProcessGrid(with_mod(inner), {}, [{"partition-id": c} for c in range(5)])
    replies, secure = unpack(secure_exchange(grid, training_messages(5), SETTINGS, None, weighting))
    assert secure is not None and secure.nodes == frozenset(range(1001, 1006))
    expected = plain_mean(inner, list(range(5)), weighting)
    bound = quantization_bound(list(range(5)), weighting)
    for name, mean in expected.items():
        error = np.abs(secure.update[name].numpy() - mean).max()
        assert error <= bound, (name, error, bound)
        assert np.abs(mean).max() > 100 * bound  # the comparison is not trivial
    trains = [r for r in replies if not r.has_error()]
    assert len(trains) == 5
    for reply in trains:
        assert all(len(record) == 0 for record in reply.content.array_records.values())
        assert not any(name.startswith("fitres.") for name in reply.content)
        assert reply.content[P.METRICS][P.SECAGG_CLIPPED] == 0
    # the protocol's own traffic is counted: 5 masked vectors of 1 + 29 int64 values up at least
    outcome = secure_exchange(grid, training_messages(5), SETTINGS, None, weighting)
    assert outcome.bytes_up > 5 * 30 * 8 and outcome.bytes_down > 0
    # every message the server sent in the clear holds only the payload: the sum is all it saw
    assert all(
        len(numpy_arrays(m.content.array_records.get(P.ARRAYS, ArrayRecord()))) in (0, 2)
        for m in grid.sent
    )


def test_a_client_that_drops_mid_training_is_unmasked_out_of_the_sum() -> None:
    """Client 2 raises after the keys were shared: the others' pairwise masks with it are rebuilt
    from its shares and removed; the mean is the other 4's."""
    inner = FixedUpdates(failing=frozenset({2}))
    grid = InProcessGrid(with_mod(inner), {}, [{"partition-id": c} for c in range(5)])
    replies, secure = unpack(
        secure_exchange(grid, training_messages(5), SETTINGS, None, "examples")
    )
    assert secure is not None and secure.nodes == frozenset({1001, 1002, 1004, 1005})
    survivors = [0, 1, 3, 4]
    expected = plain_mean(inner, survivors, "examples")
    for name, mean in expected.items():
        assert np.abs(secure.update[name].numpy() - mean).max() <= quantization_bound(
            survivors, "examples"
        )
    assert sum(r.has_error() for r in replies) == 1


def test_too_few_survivors_give_no_aggregate() -> None:
    """3 clients, threshold 2 of 3 shares: with 2 of them crashing, the masks cannot be removed."""
    inner = FixedUpdates(failing=frozenset({0, 1}))
    grid = InProcessGrid(with_mod(inner), {}, [{"partition-id": c} for c in range(3)])
    replies, secure = unpack(
        secure_exchange(grid, training_messages(3), SETTINGS, None, "examples")
    )
    assert secure is None


@pytest.mark.parametrize(
    ("num_shares", "threshold"), [(1.0, 0.01), (1.0, 0.5), (0.3, 1.0), (3.0, 2.0), (5.0, 4.0)]
)
def test_a_secret_never_rebuilds_from_one_share(num_shares: float, threshold: float) -> None:
    """Every accepted setting asks at least 2 shares per secret, as Flower's workflow (its
    fraction floor), and fewer shares than nodes where there is room (its neighbourhoods)."""
    config = ExperimentConfig.from_run_config(
        {"method": "fedavg", "secagg": True, "secagg-num-shares": num_shares,
         "secagg-threshold": threshold}
    )  # fmt: skip
    for sampled in range(2, 40):
        shares, needed = SecAggSettings.of(config).shares_and_threshold(sampled)
        assert 2 <= needed <= shares <= sampled, (sampled, shares, needed)


def test_values_beyond_the_clipping_range_are_counted_and_a_weight_beyond_max_refused() -> None:
    inner = FixedUpdates()
    small = SecAggSettings(1.0, 0.5, 0.02, 2**22, 100.0)
    grid = InProcessGrid(with_mod(inner), {}, [{"partition-id": c} for c in range(3)])
    replies = secure_exchange(grid, training_messages(3), small, None, "examples").replies
    received = received_tensors()
    for reply in replies:
        client_id = int(reply.content[P.METRICS][P.CLIENT_ID])
        update = inner.update(client_id, received)
        # Flower's mod clips w / max-weight times the update (its ratio quantized to 2**-22)
        weighted = {n: t.double() * 10 * (client_id + 1) / 100.0 for n, t in update.items()}
        beyond = sum(int((t.abs() > 0.02).sum()) for t in weighted.values())
        raw = sum(int((t.abs() > 0.02).sum()) for t in update.values())
        assert 0 < beyond < raw and reply.content[P.METRICS][P.SECAGG_CLIPPED] == beyond
    light = SecAggSettings(1.0, 0.5, 1.0, 2**22, 15.0)  # client 1 has 20 examples
    grid = InProcessGrid(with_mod(FixedUpdates()), {}, [{"partition-id": c} for c in range(3)])
    replies, secure = unpack(secure_exchange(grid, training_messages(3), light, None, "examples"))
    errors = [r.error.reason for r in replies if r.has_error()]
    assert len(errors) == 2 and all("secagg-max-weight" in e for e in errors)
    assert secure is None  # one survivor of 3: below the threshold


# ---------------------------------------------------------------- refusals and config
SECAGG_REFUSED = [n for n, s in METHODS.items() if s.capabilities.secagg is not None]
SECAGG_TAKEN = [n for n, s in METHODS.items() if s.capabilities.secagg is None]


@pytest.mark.parametrize("method", SECAGG_REFUSED)
def test_a_method_that_cannot_take_secagg_is_refused_at_start_with_its_reason(
    method: str,
) -> None:
    declared = METHODS[method].capabilities.secagg
    assert secagg_refusal(SimpleNamespace(method=method, dataset="digits", dp="none")) == declared
    with pytest.raises(ConfigError, match="'secagg'.*cannot take it") as refused:
        ExperimentConfig.from_run_config({**method_base(method), "secagg": True})
    assert declared in str(refused.value)


@pytest.mark.parametrize("method", SECAGG_TAKEN)
def test_a_method_that_declares_secagg_is_composed_of_the_secagg_parts(method: str) -> None:
    """Its strategy, built for a ``secagg = true`` run, exchanges its training under SecAgg+
    and updates from the unmasked mean (FedAvg's parts; no other strategy has them)."""
    from strategies.parts.averaging import SecureMeanUpdate
    from strategies.parts.exchange import SecAggExchange

    fit = TINY_SPLITS.get(method, {})
    config = ExperimentConfig.from_run_config({**method_base(method), "secagg": True, **fit})
    assert config.secagg
    strategy, _ = tiny_strategy(config.replace(num_clients=3))
    assert isinstance(strategy.exchanger, SecAggExchange), strategy.exchanger
    assert isinstance(strategy.update, SecureMeanUpdate), strategy.update
    assert {"pfedseq", "tap"} <= set(SECAGG_REFUSED) and "fedavg" in SECAGG_TAKEN


def test_secagg_is_refused_with_central_dp_and_on_multitask() -> None:
    with pytest.raises(ConfigError, match="central DP clips each client's update"):
        ExperimentConfig.from_run_config({"method": "fedavg", "secagg": True, "dp": "central"})
    with pytest.raises(ConfigError, match="owners"):
        ExperimentConfig.from_run_config(
            {"method": "fedavg", "secagg": True, "dataset": "multitask", "backbone": "mm-offline"}
        )
    ExperimentConfig.from_run_config({"method": "fedavg", "secagg": True, "dp": "local"})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("secagg-num-shares", 2.0),
        ("secagg-num-shares", 4.5),
        ("secagg-threshold", 0.0),
        ("secagg-threshold", 1.5),  # as a count, 1: one survivor's update would be unmasked
        ("secagg-threshold", 2.5),
        ("secagg-clipping-range", -1.0),
        ("secagg-quantization-range", 2**23),
        ("secagg-max-weight", 0.0),
    ],
)
def test_bad_secagg_settings_name_the_key(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key):
        ExperimentConfig.from_run_config({"method": "fedavg", "secagg": True, key: value})


# ---------------------------------------------------------------- a run
def test_a_secagg_fedavg_run_equals_the_plain_run_within_quantization(
    small_run_config: dict,
) -> None:
    """FedAvg, 4 clients, 2 rounds in process, with and without SecAgg+: the round-2 payload (the
    global after round 1) agrees within the quantization error, every training reply left its
    client without arrays, and the rounds record the clients in the sum."""
    from client_apps.app import app as client_app
    from server_apps.inprocess import simulation_node_configs
    from server_apps.runner import run_experiment

    payloads = {}
    for secagg in (False, True):
        run_config = {
            **ExperimentConfig().to_run_config(),
            **small_run_config,
            "method": "fedavg",
            "run-name": f"secagg-{secagg}",
            "secagg": secagg,
            "secagg-clipping-range": 1.0,
        }
        grid = InProcessGrid(client_app, run_config, simulation_node_configs(4))
        up: list[Message] = []

        def hook(client_id: int, reply: Message, up: list[Message] = up) -> Message:
            up.append(reply)
            return reply

        grid.reply_hook = hook
        run_experiment(grid, ExperimentConfig.from_run_config(run_config))
        second = next(
            m
            for m in grid.sent
            if m.metadata.message_type == "train"
            and m.metadata.group_id == "2"
            and P.ARRAYS in m.content.array_records
        )
        payloads[secagg] = from_array_record(second.content[P.ARRAYS])
        if secagg:
            trained = [r for r in up if P.METRICS in r.content.metric_records]
            assert trained and all(
                all(len(a) == 0 for a in r.content.array_records.values()) for r in trained
            )
            lines = (Path(run_config["output-dir"]) / "secagg-True" / "metrics.jsonl").read_text()
            records = [json.loads(line) for line in lines.splitlines()]
            assert [r["server"]["secagg-clients"] for r in records] == [4.0, 4.0]
            assert all(r["bytes-up-train"] == 0 and r["bytes-up-secagg"] > 0 for r in records)
            # the weights the server learns: num-examples / secagg-max-weight (1,000), summed
            for record in records:
                examples = sum(m["num-examples"] for m in record["train"].values())
                weight = record["server"]["secagg-weight"]
                assert weight == pytest.approx(examples / 1000.0, abs=4 * 2 / 2**22), weight
    # 4 clients, each w/W * update rounded to a step of 2 / 2**22 (w: ~340 examples, W: 1,000):
    # the mean is off by at most 4 steps / sum(w/W) ~ 1.4e-6, plus float32 rounding of the global
    step = 2 * 1.0 / 2**22
    for name, plain in payloads[False].items():
        error = (payloads[True][name].double() - plain.double()).abs().max().item()
        assert 0 < error <= 4 * step / 1.0 + 1e-6, (name, error)


# ---------------------------------------------------------------- on a loopback deployment
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_secagg_on_a_secure_loopback_deployment_equals_the_plain_run(cache_dir, tmp_path) -> None:
    """3 SuperNodes (TLS, authentication, warm executors forked from one process that imported
    their libraries once), FedAvg with SecAgg+ for 2 rounds: the protocol's 4 stages run
    through Flower's SuperLink, every training reply leaves without arrays, and the global
    after round 1 equals the plain in-process run's within the quantization error (the
    clients' round-1 training is the same, so are their losses)."""
    from deploy_support import completed_log, read_rounds
    from safetensors.torch import load_file

    from fedfm_flower.deploy import DeployOptions, LocalDeployment

    options = DeployOptions(
        num_supernodes=3,
        workdir=tmp_path / "work",
        startup_timeout=120.0,
        run_timeout=400.0,
        echo=False,
        warm_executor=True,
        shared_imports=True,
    )
    config = {
        "cache-dir": str(cache_dir),
        "output-dir": str(tmp_path / "runs"),
        "pretrain-epochs": 30,
        "seed": 0,
        "method": "fedavg",
        "num-server-rounds": 2,
        "secagg": True,
        "secagg-clipping-range": 1.0,
        "run-name": "secagg",
    }
    deployment = LocalDeployment(options)
    try:
        deployment.start()
        result = deployment.run(config)
    finally:
        deployment.stop()
    log = completed_log(deployment, result)
    assert "no aggregate" not in log and "SecAgg+ round" not in log  # no stage lost a node
    rounds = read_rounds(tmp_path / "runs" / "secagg")
    assert [r["server"]["secagg-clients"] for r in rounds] == [3.0, 3.0]
    assert all(r["bytes-up-train"] == 0 and r["bytes-up-secagg"] > 0 for r in rounds)
    assert all(r["rejected"] == {} for r in rounds)

    plain = deployment.run_in_process({**config, "secagg": False, "run-name": "plain"}, tmp_path)
    plain_rounds = read_rounds(plain)
    for client in ("0", "1", "2"):
        assert (
            rounds[0]["train"][client]["train-loss"]
            == plain_rounds[0]["train"][client]["train-loss"]
        )
    secure = load_file(tmp_path / "runs" / "secagg" / "checkpoints" / "round_00001.safetensors")
    reference = load_file(plain / "checkpoints" / "round_00001.safetensors")
    assert set(secure) == set(reference)
    step = 2 * 1.0 / 2**22
    for name, tensor in reference.items():
        error = (secure[name].double() - tensor.double()).abs().max().item()
        assert error <= 3 * step + 1e-6, (name, error)


def test_a_round_without_training_messages_sends_the_others_plainly() -> None:
    """A round whose messages are all evaluations (no client sampled to train) runs no protocol."""
    inner = FixedUpdates()
    grid = InProcessGrid(with_mod(inner), {}, [{"partition-id": c} for c in range(2)])
    message = training_messages(1)[0]
    evaluation = Message(
        message.content, dst_node_id=1001, message_type=MessageType.EVALUATE, group_id="1"
    )
    outcome = secure_exchange(grid, [evaluation], SETTINGS, None, "examples")
    assert outcome.mean is None and outcome.bytes_up == outcome.bytes_down == 0
    assert [m.metadata.message_type for m in grid.sent] == [MessageType.EVALUATE]


# ---------------------------------------------------------------- the strategy's SecAgg+ parts
def test_the_secagg_exchange_runs_the_protocol_in_federated_rounds_only() -> None:
    """A training round's replies come with the unmasked mean and the protocol's traffic,
    under the names the round record keeps; a post-training round travels plainly, with no
    traffic of its own; replies under SecAgg+ must hold no tensors."""
    from strategies.parts.exchange import SecAggExchange
    from strategies.parts.replies import NO_ARRAYS

    inner = FixedUpdates()
    grid = InProcessGrid(with_mod(inner), {}, [{"partition-id": c} for c in range(3)])
    exchange = SecAggExchange(SETTINGS, None, "examples")
    secured = exchange.exchange(grid, training_messages(3), "train")
    assert secured.under_secagg and secured.secure_mean is not None
    assert secured.secure_mean.nodes == frozenset({1001, 1002, 1003})
    assert set(secured.traffic) == {"bytes-down-secagg", "bytes-up-secagg"}
    assert all(v > 0 for v in secured.traffic.values())
    assert secured.reply_spec(SimpleNamespace()) is NO_ARRAYS
    sent = len(grid.sent)
    plain = exchange.exchange(grid, training_messages(3)[:1], "post-training")
    assert not plain.under_secagg and plain.secure_mean is None and plain.traffic == {}
    assert len(grid.sent) == sent + 1  # the message itself, no protocol stage
    strategy = SimpleNamespace()
    assert plain.reply_spec(strategy) is strategy


def test_the_secure_mean_update_adds_the_mean_of_exactly_the_accepted_replies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """global + the unmasked mean when the sum holds exactly the validated replies' nodes;
    a sum over other nodes (a summed client's reply was rejected) is discarded with a warning
    and ``secagg-clients`` 0; no mean leaves the state unchanged; a round that did not travel
    under SecAgg+ is averaged plainly."""
    from strategies.parts.averaging import SecureMeanUpdate, WeightedAverage
    from strategies.parts.exchange import RoundInputs
    from strategies.parts.replies import ClientReply

    tensors = received_tensors()
    replies = [ClientReply(c, 1001 + c, {}, 10, {}) for c in range(3)]  # no tensors travel
    step = {n: torch.full(t.shape, 0.25, dtype=torch.float64) for n, t in tensors.items()}
    mean = SecureMean(step, frozenset({1001, 1002, 1003}), 0.6)
    part = SecureMeanUpdate(WeightedAverage("examples"))
    updated, metrics = part.apply(2, tensors, replies, RoundInputs(3, True, mean))
    assert metrics == {"secagg-clients": 3.0, "secagg-weight": 0.6}
    for name, tensor in tensors.items():
        expected = (tensor.double() + 0.25).to(tensor.dtype)
        assert updated[name].dtype == tensor.dtype and torch.equal(updated[name], expected)

    with caplog.at_level("WARNING"):
        kept, metrics = part.apply(2, tensors, replies[:2], RoundInputs(3, True, mean))
        assert kept is tensors and metrics == {"secagg-clients": 0.0}
        assert "summed nodes [1001, 1002, 1003] but the valid replies came from [1001, 1002]" in (
            caplog.text
        )
        kept, metrics = part.apply(2, tensors, replies, RoundInputs(3, True, None))
        assert kept is tensors and metrics == {} and "gave no aggregate" in caplog.text

    plain = [
        ClientReply(c, 1001 + c, {n: t + c for n, t in tensors.items()}, 10, {}) for c in (0, 2)
    ]
    averaged, metrics = part.apply(2, tensors, plain, RoundInputs(2))
    assert torch.allclose(averaged["adapter.a"], tensors["adapter.a"] + 1.0)
    assert set(metrics) == {"update-norm-median"}
