"""APPLE (Luo & Wu 2022): one client's local round (core and directed relationship vector with
the scheduled proximal term) against a plain-torch loop, p's initial value, the scheduler's
values, evaluation, the server's slots and payloads, its state, and a run end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from safetensors.torch import load_file, save_file

from client_apps.apple import P_KEY, AppleClient
from fedfm_flower.config.experiment import ExperimentConfig, NodeIdentity
from fedfm_flower.methods.apple import AppleSettings
from fedfm_flower.methods.registry import method_spec
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.models import TrainableTensors
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import from_array_record, to_array_record
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.tasks.classification import ImageClassification
from server_apps.inprocess import InProcessGrid, identity_app, run_in_process
from strategies.apple import AppleStrategy
from strategies.parts.replies import ClientReply
from tests.tiny_clients import (
    TWO_LAYER_NAMES,
    TwoLayerModel,
    capture_evaluated,
    client_runtime,
    data,
    offset,
    two_layer_grads,
)

NAMES = TWO_LAYER_NAMES
N, ME = 3, 1  # three clients; the client under test is client 1 (not the first slot)


def _config(**changes: object) -> ExperimentConfig:
    """Batches of 8 of the 22 training examples, two epochs (3 batches each), 10 rounds with
    L = 3 (round 2 has lambda = (cos(pi/3) + 1)/2 = 0.75)."""
    base = {
        "lr": 0.05,
        "batch_size": 8,
        "momentum": 0.0,
        "local_epochs": 2,
        "num_server_rounds": 10,
        "apple_schedule_fraction": 0.3,
        "apple_mu": 0.4,
        "apple_p_lr": 0.05,
        **changes,
    }
    return ExperimentConfig(method="apple").replace(**base)


def _runtime(config: ExperimentConfig, state_dir: Path, model: TwoLayerModel | None = None):  # noqa: ANN202
    runtime = client_runtime(model or TwoLayerModel("adapter"), config, state_dir)
    runtime.identity = NodeIdentity(ME, ME, N)
    return runtime


def _cores(model: TwoLayerModel) -> list[dict[str, torch.Tensor]]:
    """Three distinct cores around the model's initial tensors."""
    start = model.trainable().tensors
    return [offset(start, 10 + j, 0.3) for j in range(N)]


def _message(cores: list[dict[str, torch.Tensor]], me: int = ME) -> dict[str, torch.Tensor]:
    """What the server sends client ``me``: its core by name, the others' by
    ``apple-core/<j>/<name>`` (written out here, not through the method's helper)."""
    sent = {n: cores[me][n].clone() for n in NAMES}
    for j, core in enumerate(cores):
        if j != me:
            sent.update({f"apple-core/{j}/{n}": core[n].clone() for n in NAMES})
    return sent


def _hand_apple(
    cores: list[dict[str, torch.Tensor]],
    p_start: torch.Tensor,
    config: ExperimentConfig,
    seed: int,
    lam: float,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """By hand in plain torch, one local round of client ME over the round's seeded batches:
    w = sum_j p_j theta_j; g = grad F(w) (the tiny model's hand gradient); the core's gradient
    p_ME g (+ weight decay), p_j's <g, theta_j> + lam mu (p_j - 1/N); heavy-ball SGD as torch's
    (buffer = gradient first, then momentum * buffer + gradient), p without weight decay.
    Returns (theta_ME, p)."""
    examples = data(22, 1)  # the train split of ``client_runtime``
    theta = {n: cores[ME][n].clone() for n in NAMES}
    p = p_start.clone()
    p0 = torch.full((N,), 1.0 / N)
    mu, p_lr = config.method_settings.mu, config.method_settings.p_lr
    m, wd = config.momentum, config.weight_decay
    theta_buf: dict[str, torch.Tensor] | None = None
    p_buf: torch.Tensor | None = None
    generator = torch.Generator().manual_seed(seed)
    for _ in range(config.local_epochs):
        for x, y in ImageClassification().batches(examples, config.batch_size, generator):
            current = [theta if j == ME else cores[j] for j in range(N)]
            w = {n: sum(p[j] * current[j][n] for j in range(N)) for n in NAMES}
            g = dict(zip(NAMES, two_layer_grads(w, x, y), strict=True))
            theta_grad = {n: p[ME] * g[n] + wd * theta[n] for n in NAMES}
            p_grad = torch.stack(
                [sum((g[n] * current[j][n]).sum() for n in NAMES) for j in range(N)]
            )
            p_grad = p_grad + lam * mu * (p - p0)
            if theta_buf is None or p_buf is None:
                theta_buf, p_buf = theta_grad, p_grad
            else:
                theta_buf = {n: m * theta_buf[n] + theta_grad[n] for n in NAMES}
                p_buf = m * p_buf + p_grad
            theta = {n: theta[n] - config.lr * theta_buf[n] for n in NAMES}
            p = p - p_lr * p_buf
    return theta, p


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[n], b[n], atol=1e-6) for n in NAMES)


# ----------------------------------------------------------------------------- the client


@pytest.mark.parametrize(
    ("changes", "saved", "lam"),
    [
        ({}, False, 0.75),  # p from p_0 = 1/N; round 2 of L = 3 (cosine)
        ({"momentum": 0.9, "weight_decay": 0.01}, True, 0.75),  # torch SGD's heavy ball
        ({"apple_schedule": "exponential"}, True, 0.001 ** (1 / 3)),
        ({"apple_schedule_fraction": 0.1}, True, 0.0),  # L = 1: no term from round 2 on
    ],
)
def test_a_local_round_matches_a_plain_torch_loop(
    tmp_path: Path, changes: dict, saved: bool, lam: float
) -> None:
    config = _config(**changes)
    runtime = _runtime(config, tmp_path / "state")
    cores = _cores(TwoLayerModel("adapter"))
    received = _message(cores)
    kept = {n: t.clone() for n, t in received.items()}
    p_start = torch.full((N,), 1.0 / N)
    if saved:  # the p the client kept from its round 1
        p_start = torch.tensor([0.2, 0.7, 0.15])
        runtime.store.save(1, {P_KEY: p_start})
    sent, stats = AppleClient().train(runtime, received, 2)
    theta, p = _hand_apple(cores, p_start, config, runtime.seed(2), lam)
    assert list(sent) == list(NAMES)  # only the core travels: p stays on the client
    assert _close(sent, theta)
    assert torch.allclose(runtime.store.load(before=3)[P_KEY], p, atol=1e-6)
    assert all(torch.equal(received[k], kept[k]) for k in kept)  # the message is untouched
    # Both moved, and p by more than its proximal pull alone would move it.
    assert max((sent[n] - cores[ME][n]).abs().max().item() for n in NAMES) > 1e-3
    assert (p - p_start).abs().max().item() > 1e-3
    assert stats.num_steps == 6 and stats.examples_seen == 44


def test_p_starts_uniform_and_a_zero_p_lr_keeps_it_there(tmp_path: Path) -> None:
    config = _config(apple_p_lr=0.0)
    runtime = _runtime(config, tmp_path)
    cores = _cores(TwoLayerModel("adapter"))
    sent, _ = AppleClient().train(runtime, _message(cores), 1)
    assert torch.equal(runtime.store.load(before=2)[P_KEY], torch.full((N,), 1.0 / N))
    theta, _ = _hand_apple(cores, torch.full((N,), 1.0 / N), config, runtime.seed(1), 1.0)
    assert _close(sent, theta)


def test_the_backbone_stays_frozen(tmp_path: Path) -> None:
    class Stemmed(TwoLayerModel):
        """A frozen stem (no group: backbone) before the two trainable layers."""

        def __init__(self) -> None:
            super().__init__("adapter")
            self.stem = torch.nn.Linear(4, 4)
            self.stem.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(self.stem(x))

    model = Stemmed()
    stem = {k: v.clone() for k, v in model.stem.state_dict().items()}
    runtime = _runtime(_config(), tmp_path, model)
    sent, _ = AppleClient().train(runtime, _message(_cores(model)), 1)
    assert set(sent) == set(NAMES)
    assert all(torch.equal(model.stem.state_dict()[k], v) for k, v in stem.items())
    assert not model.stem.weight.requires_grad


def test_evaluation_mixes_the_received_cores_with_the_kept_p(tmp_path: Path) -> None:
    config = _config()
    runtime = _runtime(config, tmp_path / "state")
    cores = _cores(TwoLayerModel("adapter"))
    evaluated = capture_evaluated(runtime)
    AppleClient().evaluate(runtime, _message(cores), 0)  # never trained: p_0 = 1/N
    assert _close(evaluated, {n: sum(c[n] for c in cores) / N for n in NAMES})

    AppleClient().train(runtime, _message(cores), 1)
    p = runtime.store.load(before=2)[P_KEY]
    later = _cores(TwoLayerModel("adapter"))[::-1]  # round 2's cores, as the server sends them
    AppleClient().evaluate(runtime, _message(later), 1)
    assert _close(evaluated, {n: sum(p[j] * later[j][n] for j in range(N)) for n in NAMES})


def test_a_message_without_every_core_or_for_another_n_is_refused(tmp_path: Path) -> None:
    runtime = _runtime(_config(), tmp_path)
    cores = _cores(TwoLayerModel("adapter"))
    partial = {k: v for k, v in _message(cores).items() if not k.startswith("apple-core/0/")}
    with pytest.raises(ValueError, match=r"cores of clients \[2\]"):
        AppleClient().train(runtime, partial, 1)
    runtime.store.save(1, {P_KEY: torch.full((4,), 0.25)})
    with pytest.raises(ValueError, match="kept p for 4 clients, but the server sent 3"):
        AppleClient().train(runtime, _message(cores), 2)


def test_under_local_dp_the_core_is_clipped_around_the_own_core_received(tmp_path: Path) -> None:
    """The reply leaves the client as received own core + clip(theta_i - received own core):
    the other cores in the message are no base of it."""
    from client_apps.app import _privatized

    config = _config(dp="local", dp_clipping_norm=0.01, dp_noise_multiplier=0.0)
    runtime = _runtime(config, tmp_path)
    cores = _cores(TwoLayerModel("adapter"))
    received = _message(cores)
    sent, _ = AppleClient().train(runtime, received, 1)
    private = _privatized(runtime, AppleClient(), sent, received)
    assert set(private) == set(NAMES)
    delta = {n: (private[n] - cores[ME][n]).double() for n in NAMES}
    assert math.sqrt(sum(float(d.pow(2).sum()) for d in delta.values())) == pytest.approx(
        0.01, rel=1e-5
    )
    direction = {n: (sent[n] - cores[ME][n]).double() for n in NAMES}
    ratio = delta["head.bias"] / direction["head.bias"]
    assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-4)  # the same direction


# ----------------------------------------------------------------------------- the settings


def test_the_scheduler_values() -> None:
    settings = AppleSettings(schedule_fraction=0.2)
    assert settings.decay_rounds(20) == 4 and settings.decay_rounds(3) == 1
    cosine = [settings.proximal_weight(t, 20) for t in range(1, 8)]
    expected = [(math.cos(math.pi * r / 4) + 1) / 2 for r in range(4)] + [0.0] * 3
    assert cosine == pytest.approx(expected, abs=1e-12)
    assert cosine[:3] == pytest.approx([1.0, (2**-0.5 + 1) / 2, 0.5])
    exponential = settings.replace(schedule="exponential")
    values = [exponential.proximal_weight(t, 20) for t in range(1, 7)]
    assert values == pytest.approx([1.0, 1e-3**0.25, 1e-3**0.5, 1e-3**0.75, 0.0, 0.0])
    short = AppleSettings()  # L = max(1, int(0.1 * 5)) = 1
    assert [short.proximal_weight(t, 5) for t in (1, 2, 5)] == [1.0, 0.0, 0.0]


def test_settings_defaults_rules_and_spec() -> None:
    assert AppleSettings() == AppleSettings(
        p_lr=0.001, mu=0.1, schedule="cosine", schedule_fraction=0.1
    )
    assert AppleSettings.keys() == (
        "apple-p-lr",
        "apple-mu",
        "apple-schedule",
        "apple-schedule-fraction",
    )
    bad = (
        ("apple-p-lr", -0.1, "must be >= 0"),
        ("apple-mu", -1.0, "must be >= 0"),
        ("apple-schedule", "linear", "allowed: cosine, exponential"),
        ("apple-schedule-fraction", 0.0, r"must lie in \(0.0, 1.0\]"),
        ("apple-schedule-fraction", 1.5, r"must lie in \(0.0, 1.0\]"),
    )
    for key, value, rule in bad:
        with pytest.raises(ConfigError, match=f"'{key}' = '?{value}'? is invalid: {rule}"):
            ExperimentConfig.from_run_config({"method": "apple", key: value})
    spec = method_spec("apple")
    assert spec.strategy == "strategies.apple:AppleStrategy" and spec.tuner == "lora"
    # pFedSeq's grid for p's learning rate lies inside the search space.
    assert all(spec.search["apple-p-lr"].contains(v) for v in (0.001, 0.01, 0.1, 1.0))
    assert spec.capabilities.local_dp is None
    for mechanism in ("central-dp", "secagg"):
        assert spec.capabilities.refusal(mechanism) is not None
        key = {"central-dp": {"dp": "central"}, "secagg": {"secagg": True}}[mechanism]
        with pytest.raises(ConfigError, match="cannot take it"):
            ExperimentConfig.from_run_config({"method": "apple", **key})


# ----------------------------------------------------------------------------- the server

CORE = {"adapter.a": (4, 3), "head.w": (2,)}


def _strategy(num_clients: int = N) -> AppleStrategy:
    initial = TrainableTensors(
        {n: torch.arange(math.prod(s), dtype=torch.float32).reshape(s) for n, s in CORE.items()},
        {"adapter.a": "adapter", "head.w": "head"},
    )
    config = ExperimentConfig(method="apple").replace(num_clients=num_clients)
    return AppleStrategy(config, initial)


def test_the_server_stores_exactly_the_sent_cores_and_sends_each_client_all_of_them() -> None:
    strategy = _strategy()
    initial = {n: t.clone() for n, t in strategy.initial_core.items()}
    run_config = strategy.config.to_run_config()
    grid = InProcessGrid(identity_app(), run_config, [{"client-id": i} for i in range(N)])
    generator = torch.Generator().manual_seed(0)
    sent = {c: {n: torch.randn(s, generator=generator) for n, s in CORE.items()} for c in (0, 2)}
    for server_round in (1, 2):
        messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))
        replies = []
        for message in messages:
            client = int(message.content[P.CONFIG][P.CLIENT_ID])
            got = from_array_record(message.content[P.ARRAYS])
            slots = (
                [initial, initial, initial] if server_round == 1 else [sent[0], initial, sent[2]]
            )
            expected = {n: slots[client][n] for n in CORE}
            for j in range(N):
                if j != client:
                    expected.update({f"apple-core/{j}/{n}": slots[j][n] for n in CORE})
            assert set(got) == set(expected), client
            assert all(torch.equal(got[k], expected[k]) for k in expected), client
            if client in sent:  # client 1 does not answer
                metrics = MetricRecord({P.CLIENT_ID: client, P.NUM_EXAMPLES: 5})
                content = RecordDict({P.ARRAYS: to_array_record(sent[client]), P.METRICS: metrics})
                replies.append(Message(content, reply_to=message))
        strategy.aggregate_round(server_round, None, replies)
        cores = strategy.require_server().cores
        assert all(torch.equal(cores[c][n], sent[c][n]) for c in sent for n in CORE)
        assert all(torch.equal(cores[1][n], initial[n]) for n in CORE)
    assert strategy.reply_spec(0) == {"adapter.a": ((4, 3), "float32"), "head.w": ((2,), "float32")}


def test_a_reply_replaces_only_its_senders_slot() -> None:
    strategy = _strategy()
    before = [dict(c) for c in strategy.require_server().cores]
    core = {n: torch.full(s, 7.0) for n, s in CORE.items()}
    assert strategy.aggregate(1, [ClientReply(2, 2, core, 10, {})]) == {}
    after = strategy.require_server().cores
    assert all(torch.equal(after[2][n], core[n]) for n in CORE)
    assert all(torch.equal(after[j][n], before[j][n]) for j in (0, 1) for n in CORE)
    core["head.w"].add_(1.0)  # the slot is a copy, not the reply's tensor
    assert torch.equal(after[2]["head.w"], torch.full((2,), 7.0))


def test_the_server_state_saves_and_resumes_exactly(tmp_path: Path) -> None:
    strategy = _strategy()
    generator = torch.Generator().manual_seed(1)
    replies = [
        ClientReply(c, c, {n: torch.randn(s, generator=generator) for n, s in CORE.items()}, 5, {})
        for c in range(N)
    ]
    strategy.aggregate(1, replies)
    tensors, meta = strategy.state_dict()
    save_file(tensors, str(tmp_path / "state.safetensors"))
    resumed = _strategy(num_clients=0)  # N comes from the checkpoint
    resumed.load_state_dict(load_file(str(tmp_path / "state.safetensors")), meta)
    assert resumed.require_server().num_clients == N
    for c in range(N):
        a, b = strategy.train_payload(c, 2), resumed.train_payload(c, 2)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="do not match this APPLE configuration"):
        resumed.load_state_tensors({k: v for k, v in tensors.items() if "head" not in k})


# ----------------------------------------------------------------------------- end to end


def test_a_run_finishes_and_evaluates_the_personalized_models(
    small_run_config: dict, tmp_path: Path
) -> None:
    config = {
        **small_run_config,
        "method": "apple",
        "apple-p-lr": 0.01,
        "run-name": "apple",
        "client-state-dir": str(tmp_path / "state"),
    }
    summary, _ = run_in_process(config, num_nodes=4)
    records = RunDirectory(Path(config["output-dir"]) / summary["run-name"]).rounds()
    assert summary["rounds"] == 2 and len(records) == 2
    assert set(summary["final-per-client-accuracy"]) == {"0", "1", "2", "3"}
    assert 0.0 <= summary["final-test-accuracy-mean"] <= 1.0
    clients = sorted((tmp_path / "state" / "apple").iterdir())
    assert [c.name for c in clients] == [f"client_{i}" for i in range(4)]
    for client in clients:  # each client kept its own p, for the 4 clients
        kept = load_file(str(client / "round_00002.safetensors"))
        assert set(kept) == {P_KEY} and kept[P_KEY].shape == (4,)
