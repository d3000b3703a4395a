"""FedALA (Zhang et al. 2023): one ALA weight update against plain torch, the top-p choice, W's
state across rounds, W = 1 and eta = 0 as FedAvg, the start phase, and a run end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict

from client_apps.fedala import W_PREFIX, FedALAClient, consecutive_sample
from client_apps.split import SplitClient
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods import AVERAGE_ONLY, ResourceProfile
from fedfm_flower.methods.fedala import FedALASettings
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.registry import method_spec
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import numpy_arrays
from tests.tiny_clients import (
    TWO_LAYER_NAMES,
    TwoLayerModel,
    capture_evaluated,
    client_runtime,
    data,
    offset,
)

NAMES = TWO_LAYER_NAMES
TOP = ("head.weight", "head.bias")


def _config(method: str = "fedala", **changes: object) -> ExperimentConfig:
    """Plain SGD on batches of 8 of the 22 training examples; ALA on the head (p = 2)."""
    base = {"lr": 0.3, "batch_size": 8, "momentum": 0.0, "local_epochs": 1, **changes}
    if method == "fedala":
        base = {"fedala_layers": 2, "fedala_eta": 1.0, **base}
    return ExperimentConfig(method=method).replace(**base)


def _loss_and_grads(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):  # noqa: ANN202
    """By hand: mean cross-entropy of head(tanh(body(x))) and its gradient on the head."""
    leaves = {n: t.clone().requires_grad_(n in TOP) for n, t in params.items()}
    hidden = torch.tanh(x @ leaves["body.weight"].T + leaves["body.bias"])
    logits = hidden @ leaves["head.weight"].T + leaves["head.bias"]
    loss = torch.nn.functional.cross_entropy(logits, y)
    return loss.item(), torch.autograd.grad(loss, [leaves[n] for n in TOP])


def _hand_ala(local, received, w, seed: int, epochs: int, eta: float = 1.0):  # noqa: ANN001, ANN202
    """By hand in plain torch: the lower layers Theta, the head theta + (Theta - theta) W; per
    batch of the in-order consecutive 80% sample, W <- clip(W - eta dL/dtheta_hat (Theta -
    theta), 0, 1), for ``epochs`` epochs. Returns (theta_hat, W, last-batch losses)."""
    examples = data(22, 1)
    generator = torch.Generator().manual_seed(seed)
    count = int(0.8 * 22)
    start = int(torch.randint(0, 22 - count + 1, (1,), generator=generator))
    x_all, y_all = (t[start : start + count] for t in examples.tensors)
    w = {n: w[n].clone() for n in TOP}
    losses = []
    for _ in range(epochs):
        for i in range(0, count, 8):
            hat = {n: received[n] for n in NAMES if n not in TOP}
            hat.update({n: local[n] + (received[n] - local[n]) * w[n] for n in TOP})
            loss, grads = _loss_and_grads(hat, x_all[i : i + 8], y_all[i : i + 8])
            for n, g in zip(TOP, grads, strict=True):
                w[n] = torch.clamp(w[n] - eta * g * (received[n] - local[n]), 0, 1)
        losses.append(loss)
    hat = {n: received[n] for n in NAMES if n not in TOP}
    hat.update({n: local[n] + (received[n] - local[n]) * w[n] for n in TOP})
    return hat, w, losses


def _keep(runtime, local: dict, w: dict | None = None) -> None:  # noqa: ANN001
    """Make ``local`` (and W) the client's state after round 1."""
    state = {n: local[n] for n in TOP}
    if w is not None:
        state.update({W_PREFIX + n: w[n] for n in TOP})
    runtime.store.save(1, state)


# ----------------------------------------------------------------------------- the client


def test_one_ala_update_matches_plain_torch_and_lower_layers_take_theta(tmp_path: Path) -> None:
    config = _config(fedala_sample_ratio=0.8)
    model = TwoLayerModel()
    runtime = client_runtime(model, config, tmp_path / "state")
    initial = model.trainable().tensors
    received = offset(initial, 1, 0.5)
    local = offset(initial, 2, 1.0)
    w0 = {n: torch.full_like(local[n], 0.6) for n in TOP}
    _keep(runtime, local, w0)  # not the start phase: one epoch of W
    seen = {}

    def spy(model, names, seed, **options):  # noqa: ANN001, ANN003, ANN202
        seen.update({n: model.get_parameter(n).detach().clone() for n in NAMES})
        return type(runtime).train(runtime, model, names, seed, steps=0, epochs=0)

    runtime.train = spy  # capture theta_hat, the local training's start (and skip it)
    sent, stats = FedALAClient().train(runtime, received, 2)
    hat, w, _ = _hand_ala(local, received, w0, runtime.seed(2, salt=4), epochs=1)
    for name in NAMES:
        assert torch.allclose(seen[name], hat[name], atol=1e-6), name
    for name in ("body.weight", "body.bias"):
        assert torch.equal(seen[name], received[name])  # lower layers: Theta exactly
    kept = runtime.store.load(before=3)
    assert set(kept) == set(TOP) | {W_PREFIX + n for n in TOP}
    for name in TOP:
        assert torch.allclose(kept[W_PREFIX + name], w[name], atol=1e-6), name
        assert (kept[W_PREFIX + name] - w0[name]).abs().max() > 1e-3  # W did move
        assert kept[W_PREFIX + name].min() >= 0 and kept[W_PREFIX + name].max() <= 1
    assert list(sent) == list(NAMES)  # the model only, never W
    assert stats.num_steps == 3 and stats.examples_seen == 17  # one epoch of int(0.8 * 22)


def test_top_p_is_the_last_p_trainable_tensors() -> None:
    settings = FedALASettings()
    assert settings.top(list(NAMES)) == list(NAMES)  # 0: all, as the authors' layer_idx = 0
    assert settings.replace(layers=2).top(list(NAMES)) == list(TOP)  # the paper's top layer
    assert settings.replace(layers=1).top(list(NAMES)) == ["head.bias"]
    assert settings.replace(layers=9).top(list(NAMES)) == list(NAMES)


def test_w_persists_per_client_across_rounds_and_is_never_sent(tmp_path: Path) -> None:
    config = _config(fedala_threshold=10.0, fedala_num_pre_loss=2)
    model = TwoLayerModel()
    runtime = client_runtime(model, config, tmp_path / "state")
    initial = model.trainable().tensors
    # Round 1: theta = Theta^0 = the received model: ALA skipped, no W yet.
    sent1, stats1 = FedALAClient().train(runtime, initial, 1)
    kept1 = runtime.store.load(before=2)
    assert set(kept1) == set(TOP) and all(torch.equal(kept1[n], sent1[n]) for n in TOP)
    assert stats1.num_steps == 3  # local training only
    # Round 2: the start phase, W from ones, num-pre-loss + 1 = 3 epochs (threshold met).
    received = offset(initial, 3, 0.5)
    sent2, stats2 = FedALAClient().train(runtime, received, 2)
    assert list(sent2) == list(NAMES)
    kept2 = runtime.store.load(before=3)
    ones = {n: torch.ones_like(initial[n]) for n in TOP}
    _, w2, _ = _hand_ala(sent1, received, ones, runtime.seed(2, salt=4), epochs=3)
    assert all(torch.allclose(kept2[W_PREFIX + n], w2[n], atol=1e-6) for n in TOP)
    assert stats2.num_steps == 3 * 3 + 3
    # A restart reads theta and W from disk; round 3 continues from that W, one epoch.
    restarted = client_runtime(TwoLayerModel(), config, tmp_path / "state", state=RecordDict())
    received3 = offset(received, 4, 0.3)
    _, stats3 = FedALAClient().train(restarted, received3, 3)
    kept3 = restarted.store.load(before=4)
    _, w3, _ = _hand_ala(
        {n: kept2[n] for n in TOP}, received3, w2, restarted.seed(3, salt=4), epochs=1
    )
    assert all(torch.allclose(kept3[W_PREFIX + n], w3[n], atol=1e-6) for n in TOP)
    assert stats3.num_steps == 3 + 3
    # Evaluation mixes the received model with the kept W, untrained; state is untouched.
    evaluated = capture_evaluated(restarted)
    FedALAClient().evaluate(restarted, received3, 3)
    for n in TOP:
        expected = torch.lerp(kept3[n], received3[n], kept3[W_PREFIX + n])
        assert torch.allclose(evaluated[n], expected, atol=1e-7)
    assert all(torch.equal(evaluated[n], received3[n]) for n in ("body.weight", "body.bias"))
    assert restarted.store.rounds()[-1] == 3


def test_w_one_and_eta_zero_is_fedavg_bit_for_bit(tmp_path: Path) -> None:
    model = TwoLayerModel()
    initial = model.trainable().tensors
    received = offset(initial, 5, 0.4)
    local = offset(initial, 6, 1.0)
    sent = {}
    for method in ("fedavg", "fedala"):
        changes = {"fedala_eta": 0.0, "fedala_layers": 0} if method == "fedala" else {}
        runtime = client_runtime(model, _config(method, **changes), tmp_path / method)
        if method == "fedala":
            runtime.store.save(
                1, {**local, **{W_PREFIX + n: torch.ones_like(local[n]) for n in NAMES}}
            )
            client = FedALAClient()
        else:
            client = SplitClient()
        sent[method], _ = client.train(runtime, received, 2)
    assert list(sent["fedala"]) == list(sent["fedavg"]) == list(NAMES)
    assert all(torch.equal(sent["fedala"][n], sent["fedavg"][n]) for n in NAMES)


def test_start_phase_trains_until_the_losses_settle(tmp_path: Path) -> None:
    model = TwoLayerModel()
    initial = model.trainable().tensors
    received = offset(initial, 7, 0.5)
    local = offset(initial, 8, 1.0)

    def ala_steps(**changes: object) -> int:
        runtime = client_runtime(model, _config(**changes), tmp_path / str(len(changes)))
        _keep(runtime, local)  # theta kept, no W yet: the start phase
        return FedALAClient().train(runtime, received, 2)[1].num_steps - 3

    assert ala_steps(fedala_threshold=100.0, fedala_num_pre_loss=4) == 5 * 3
    assert ala_steps(fedala_threshold=0.0, fedala_num_pre_loss=2, fedala_max_epochs=7) == 7 * 3
    settings = FedALASettings(threshold=0.1, num_pre_loss=3)
    assert not settings.converged([1.0, 1.0, 1.0])  # needs more than num-pre-loss
    assert settings.converged([5.0, 1.0, 1.05, 0.95])
    assert not settings.converged([1.0, 1.0, 2.0, 1.0])


def test_the_sample_is_consecutive_rows_from_a_random_start() -> None:
    examples = data(22, 1)
    generator = torch.Generator().manual_seed(3)
    sample = consecutive_sample(examples, 0.5, generator)
    assert len(sample) == 11
    start = int(torch.nonzero((examples.tensors[0] == sample.tensors[0][0]).all(1))[0])
    assert torch.equal(sample.tensors[0], examples.tensors[0][start : start + 11])
    assert len(consecutive_sample(examples, 1.0, generator)) == 22


def test_settings_defaults_rules_and_spec() -> None:
    settings = FedALASettings()
    assert (settings.layers, settings.sample_ratio, settings.eta) == (0, 0.8, 0.1)
    assert (settings.threshold, settings.num_pre_loss, settings.max_epochs) == (1.0, 10, 0)
    assert FedALASettings.keys() == (
        "fedala-layers",
        "fedala-sample-ratio",
        "fedala-eta",
        "fedala-threshold",
        "fedala-num-pre-loss",
        "fedala-max-epochs",
    )
    for bad in ({"fedala-sample-ratio": 0.0}, {"fedala-sample-ratio": 1.5}, {"fedala-eta": -1}):
        with pytest.raises(ConfigError, match="fedala-"):
            ExperimentConfig.from_run_config({"method": "fedala", **bad})
    config = ExperimentConfig.from_run_config({"method": "fedala", "fedala-layers": "2"})
    assert config.method_settings == FedALASettings(layers=2)
    spec = method_spec("fedala")
    assert spec.strategy == "strategies.fedavg:FedAvgStrategy" and spec.tuner == "lora"
    assert spec.capabilities == AVERAGE_ONLY
    assert spec.profile == ResourceProfile(copies=2, passes=2)
    assert spec.search == {"fedala-eta": LogUniform(0.001, 1.0)}  # pFedSeq's grid ends


# ----------------------------------------------------------------------------- end to end


def test_a_tiny_run_finishes_and_keeps_w_on_the_clients(
    small_run_config: dict, tmp_path: Path
) -> None:
    from server_apps.inprocess import run_in_process

    replies: list[dict] = []

    def keep(client_id: int, reply):  # noqa: ANN001, ANN202
        if reply.metadata.message_type == "train" and P.ARRAYS in reply.content.array_records:
            replies.append(numpy_arrays(reply.content.array_records[P.ARRAYS]))
        return reply

    config = {
        **small_run_config,
        "num-server-rounds": 3,
        "method": "fedala",
        "fedala-max-epochs": 3,
        "run-name": "fedala",
        "client-state-dir": str(tmp_path / "state"),
    }
    summary, _ = run_in_process(config, num_nodes=4, reply_hook=keep)
    assert summary["rounds"] == 3
    assert set(summary["final-per-client-accuracy"]) == {"0", "1", "2", "3"}
    assert 0.2 < summary["final-test-accuracy-mean"] <= 1.0  # chance is 0.1
    assert len(replies) == 12 and not any(W_PREFIX in n for r in replies for n in r)
    clients = sorted((tmp_path / "state" / "fedala").iterdir())
    assert [c.name for c in clients] == [f"client_{i}" for i in range(4)]
    assert all((c / "round_00003.safetensors").is_file() for c in clients)
