"""FedPerfix's Table 2 baselines: FedBABU, APFL and Per-FedAvg, on tiny models by hand.

The end-to-end runs of the three methods are in ``tests/test_end_to_end.py``
(``test_each_baseline_runs_two_rounds``); here each method's client half runs on a linear or
two-layer model with hand-made data, and its updates are checked against hand computations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict
from torch import nn

from client_apps.apfl import ALPHA_KEY, APFLClient, apfl_step
from client_apps.fedbabu import FedBABUClient
from client_apps.perfedavg import PerFedAvgClient, perfedavg_step
from client_apps.stepwise import halves, trainable_only
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods import registry
from fedfm_flower.methods.apfl import APFLSettings
from fedfm_flower.methods.perfedavg import PerFedAvgSettings
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.models import build_model
from fedfm_flower.tasks.classification import ImageClassification
from strategies.fedavg import FedAvgStrategy
from tests.tiny_clients import (
    IN,
    LinearModel,
    TwoLayerModel,
    capture_evaluated,
    ce_grads,
    client_runtime,
)


def _linear_params(model: LinearModel) -> dict[str, nn.Parameter]:
    return model.parameters_named(["head.weight", "head.bias"])


# ----------------------------------------------------------------------------- FedBABU


def test_fedbabu_head_is_frozen_never_sent_and_fine_tuned_only_to_evaluate(
    tmp_path: Path,
) -> None:
    model = TwoLayerModel()
    config = ExperimentConfig(method="fedbabu", lr=0.1, batch_size=4, finetune_epochs=2)
    runtime = client_runtime(model, config, tmp_path)
    initial = model.trainable()
    strategy = FedAvgStrategy(config, initial)
    received = strategy.train_payload(0, 1)
    assert set(received) == {"body.weight", "body.bias"}  # the head is never sent down
    assert set(strategy.reply_spec(0)) == set(received)  # nor accepted up

    sent, stats = FedBABUClient().train(runtime, received, 1)
    assert set(sent) == {"body.weight", "body.bias"}
    assert stats.examples_seen == 22
    assert not torch.equal(sent["body.weight"], received["body.weight"])  # the body trained
    for name in ("head.weight", "head.bias"):  # the head after local training: bit-identical
        assert torch.equal(model.get_parameter(name).detach(), initial.tensors[name])
    assert runtime.store.rounds() == []  # nothing is personal state

    evaluated = capture_evaluated(runtime)
    body = {**received, **sent}
    FedBABUClient().evaluate(runtime, body, 1)
    for name in ("body.weight", "body.bias"):  # the body stayed fixed while the head tuned
        assert torch.equal(evaluated[name], body[name])
    assert not torch.equal(evaluated["head.weight"], initial.tensors["head.weight"])
    # Nothing of the fine-tuning is kept: the next message starts from the initial head.
    assert torch.equal(runtime.model().head.weight.detach(), initial.tensors["head.weight"])


def test_fedbabu_head_is_the_same_seeded_initialisation_on_every_node() -> None:
    config = ExperimentConfig(method="fedbabu")
    assert registry.trains_backbone(config) and registry.tuner_of(config) == "none"
    heads = [
        build_model(config, "none", 10, load_weights=False, train_backbone=True).trainable()
        for _ in range(2)
    ]
    names = [n for n, g in heads[0].groups.items() if g == "head"]
    assert names and all(torch.equal(heads[0].tensors[n], heads[1].tensors[n]) for n in names)
    assert all(g.startswith("vit.") for n, g in heads[0].groups.items() if n not in names)


# ----------------------------------------------------------------------------- APFL


def test_apfl_step_matches_the_hand_computed_updates_of_w_v_and_alpha() -> None:
    model = LinearModel()
    w = _linear_params(model)
    w0 = {n: p.detach().clone() for n, p in w.items()}
    generator = torch.Generator().manual_seed(3)
    v = {n: t + torch.randn(t.shape, generator=generator) for n, t in w0.items()}
    v0 = {n: t.clone() for n, t in v.items()}
    batch = (torch.randn(6, IN, generator=generator), torch.tensor([0, 1, 2, 2, 1, 0]))
    alpha, lr, alpha_lr = 0.3, 0.5, 0.2
    with trainable_only(model, w.values()):
        _, new_alpha = apfl_step(ImageClassification(), model, w, v, alpha, batch, lr, alpha_lr)
    names = ("head.weight", "head.bias")
    mixed = [alpha * v0[n] + (1 - alpha) * w0[n] for n in names]
    g_mixed = ce_grads(*mixed, batch)  # the gradient at the mixed parameters
    g_w = ce_grads(w0["head.weight"], w0["head.bias"], batch)
    d_alpha = sum((g * (v0[n] - w0[n])).sum() for g, n in zip(g_mixed, names, strict=True))
    assert new_alpha == pytest.approx(alpha - alpha_lr * d_alpha.item(), abs=1e-6)
    assert 0.0 < new_alpha < 1.0 and new_alpha != alpha
    for n, g_m, g in zip(names, g_mixed, g_w, strict=True):
        assert torch.allclose(w[n].detach(), w0[n] - lr * g, atol=1e-6)  # (a)
        assert torch.allclose(v[n], v0[n] - lr * alpha * g_m, atol=1e-6)  # (b): w fixed


def test_apfl_alpha_is_clipped_to_the_unit_interval() -> None:
    model = LinearModel()
    w = _linear_params(model)
    generator = torch.Generator().manual_seed(4)
    v = {n: p.detach() + torch.randn(p.shape, generator=generator) for n, p in w.items()}
    batch = (torch.randn(6, IN, generator=generator), torch.tensor([0, 1, 2, 2, 1, 0]))
    ends = set()
    with trainable_only(model, w.values()):
        for alpha_lr in (1e6, -1e6):  # a huge step either way (a negative one flips the sign)
            _, alpha = apfl_step(ImageClassification(), model, w, v, 0.5, batch, 0.0, alpha_lr)
            assert 0.0 <= alpha <= 1.0
            ends.add(alpha)
    assert ends == {0.0, 1.0}


def test_apfl_keeps_v_and_alpha_off_the_messages_and_restores_them_from_disk(
    tmp_path: Path,
) -> None:
    model = TwoLayerModel()
    config = ExperimentConfig(method="apfl", lr=0.1, batch_size=4).replace(apfl_alpha_lr=0.5)
    runtime = client_runtime(model, config, tmp_path / "state")
    names = list(model.parameter_groups())
    strategy = FedAvgStrategy(config, model.trainable())
    received = strategy.train_payload(0, 1)
    assert list(received) == names and list(strategy.reply_spec(0)) == names

    sent, stats = APFLClient().train(runtime, received, 1)
    assert list(sent) == names  # w only: no alpha, and v under w's names is never sent
    assert stats.examples_seen == 22 and stats.num_steps == 6
    saved = runtime.store.load(before=2)
    assert saved is not None and set(saved) == {*names, ALPHA_KEY}
    alpha = saved.pop(ALPHA_KEY).item()
    assert 0.0 <= alpha <= 1.0 and alpha != 0.25  # it moved from apfl-alpha
    assert not any(torch.equal(saved[n], sent[n]) for n in names)  # v is not w
    assert all(torch.equal(model.get_parameter(n).detach(), sent[n]) for n in names)

    # A restart: a fresh context (empty memory state) reads v and alpha from disk.
    restarted = client_runtime(TwoLayerModel(), config, tmp_path / "state", state=RecordDict())
    v, restored = APFLClient().personal(restarted, restarted.model(), {"before": 2})
    assert restored == alpha and all(torch.equal(v[n], saved[n]) for n in names)
    evaluated = capture_evaluated(restarted)
    APFLClient().evaluate(restarted, sent, 1)
    for n in names:  # the personalised model: alpha v + (1 - alpha) w
        assert torch.allclose(evaluated[n], alpha * saved[n] + (1 - alpha) * sent[n], atol=1e-6)


def test_apfl_settings_defaults_and_rules() -> None:
    settings = APFLSettings()
    assert (settings.alpha, settings.alpha_lr) == (0.25, 0.0)
    assert settings.alpha_step(0.02) == 0.02 and settings.replace(alpha_lr=0.1).alpha_step(1) == 0.1
    with pytest.raises(ConfigError, match="apfl-alpha"):
        ExperimentConfig.from_run_config({"method": "apfl", "apfl-alpha": 1.5})
    config = ExperimentConfig.from_run_config({"method": "apfl", "apfl-alpha-lr": "0.3"})
    assert config.method_settings == APFLSettings(alpha_lr=0.3)


# ----------------------------------------------------------------------------- Per-FedAvg


def test_perfedavg_step_applies_the_gradient_at_the_inner_step_to_w() -> None:
    model = LinearModel()
    w = _linear_params(model)
    w0 = [p.detach().clone() for p in w.values()]
    generator = torch.Generator().manual_seed(5)
    first = (torch.randn(5, IN, generator=generator), torch.tensor([0, 1, 2, 0, 1]))
    second = (torch.randn(4, IN, generator=generator), torch.tensor([2, 2, 1, 0]))
    alpha, beta = 0.4, 0.3
    with trainable_only(model, w.values()):
        inner, outer = perfedavg_step(ImageClassification(), model, w, first, second, alpha, beta)
    assert (inner.count, outer.count) == (5, 4)
    g_first = ce_grads(*w0, first)
    temp = [t - alpha * g for t, g in zip(w0, g_first, strict=True)]
    g_temp = ce_grads(*temp, second)  # the gradient at temp, on D'
    for p, t, g in zip(w.values(), w0, g_temp, strict=True):
        assert torch.allclose(p.detach(), t - beta * g, atol=1e-6)
    # Not the plain step on D' at w: the inner step matters.
    g_plain = ce_grads(*w0, second)
    assert not torch.allclose(w["head.weight"].detach(), w0[0] - beta * g_plain[0], atol=1e-4)


def test_perfedavg_adapts_a_copy_with_one_step_before_evaluating(tmp_path: Path) -> None:
    model = LinearModel()
    config = ExperimentConfig(method="per-fedavg", lr=0.1, batch_size=4).replace(
        perfedavg_alpha=0.7
    )
    runtime = client_runtime(model, config, tmp_path)
    strategy = FedAvgStrategy(config, model.trainable())
    received = {n: t + 0.1 for n, t in strategy.train_payload(0, 1).items()}
    kept = {n: t.clone() for n, t in received.items()}
    evaluated = capture_evaluated(runtime)
    PerFedAvgClient().evaluate(runtime, received, 3)
    # The batch: the first of the train split in the seeded order of this round's evaluation.
    generator = torch.Generator().manual_seed(runtime.seed(3, salt=2))
    batch = next(runtime.task.batches(runtime.data.train, 4, generator))
    assert len(batch[0]) == 4
    grads = ce_grads(received["head.weight"], received["head.bias"], batch)
    for n, g in zip(("head.weight", "head.bias"), grads, strict=True):
        assert torch.allclose(evaluated[n], received[n] - 0.7 * g, atol=1e-6)
    assert all(torch.equal(received[n], kept[n]) for n in kept)  # the message is untouched
    assert runtime.store.rounds() == []


def test_perfedavg_local_steps_take_two_halves_of_a_double_batch(tmp_path: Path) -> None:
    model = LinearModel()
    config = ExperimentConfig(method="per-fedavg", lr=0.1, batch_size=4)
    runtime = client_runtime(model, config, tmp_path)
    received = FedAvgStrategy(config, model.trainable()).train_payload(0, 1)
    sent, stats = PerFedAvgClient().train(runtime, received, 1)
    assert list(sent) == ["head.weight", "head.bias"]
    assert stats.examples_seen == 22 and stats.num_steps == 3  # batches of 8: 8, 8, 6
    assert not torch.equal(sent["head.weight"], received["head.weight"])
    batch = (torch.arange(5.0), torch.arange(5))
    first, second = halves(batch)
    assert first[0].tolist() == [0, 1, 2] and second[1].tolist() == [3, 4]
    assert PerFedAvgSettings().steps(0.02) == (0.02, 0.02)
    assert PerFedAvgSettings(alpha=0.5, beta=0.1).steps(0.02) == (0.5, 0.1)
