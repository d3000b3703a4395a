"""pFedMe (Dinh et al. 2020): the inner Moreau-envelope solve and the outer step against a
plain-torch loop, the server's beta step against a hand computation, theta's state and
evaluation, and a run end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client_apps.pfedme import PFedMeClient
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods import AVERAGE_ONLY, ResourceProfile
from fedfm_flower.methods.pfedme import PFedMeSettings
from fedfm_flower.methods.ranges import LogUniform, Uniform
from fedfm_flower.methods.registry import method_spec
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.models import TrainableTensors
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.tasks.classification import ImageClassification
from server_apps.inprocess import run_in_process
from strategies.fedavg import FedAvgStrategy
from strategies.parts.replies import ClientReply
from strategies.pfedme import PFedMeStrategy
from tests.tiny_clients import (
    TWO_LAYER_NAMES,
    TwoLayerModel,
    capture_evaluated,
    client_runtime,
    data,
    kept_personal_model,
    offset,
    two_layer_grads,
)

NAMES = TWO_LAYER_NAMES


def _config(method: str = "pfedme", **changes: object) -> ExperimentConfig:
    """Batches of 8 of the 22 training examples, two epochs (3 batches each)."""
    base = {"lr": 0.05, "batch_size": 8, "momentum": 0.0, "local_epochs": 2, **changes}
    return ExperimentConfig(method=method).replace(**base)


def _hand_pfedme(
    received: dict[str, torch.Tensor],
    config: ExperimentConfig,
    seed: int,
    lam: float,
    k: int,
    personal_lr: float,
    reset_theta: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """By hand in plain torch, Algorithm 1's local rounds over the round's seeded batches:
    K times theta <- theta - plr (grad f(theta) + lam (theta - w)), then
    w <- w - lr lam (w - theta). Returns (w, theta)."""
    examples = data(22, 1)  # the train split of ``client_runtime``
    w = {n: t.clone() for n, t in received.items()}
    theta = {n: t.clone() for n, t in received.items()}
    generator = torch.Generator().manual_seed(seed)
    for _ in range(config.local_epochs):
        for x, y in ImageClassification().batches(examples, config.batch_size, generator):
            if reset_theta:
                theta = {n: t.clone() for n, t in w.items()}
            for _ in range(k):
                grads = two_layer_grads(theta, x, y)
                theta = {
                    n: theta[n] - personal_lr * (g + lam * (theta[n] - w[n]))
                    for n, g in zip(NAMES, grads, strict=True)
                }
            w = {n: w[n] - config.lr * lam * (w[n] - theta[n]) for n in NAMES}
    return w, theta


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(a[n], b[n], atol=1e-6) for n in NAMES)


# ----------------------------------------------------------------------------- the client


@pytest.mark.parametrize(("lam", "k", "personal_lr"), [(15.0, 5, 0.0), (3.0, 2, 0.1)])
def test_the_inner_solve_and_outer_step_match_a_plain_torch_loop(
    tmp_path: Path, lam: float, k: int, personal_lr: float
) -> None:
    config = _config(pfedme_lambda=lam, pfedme_inner_steps=k, pfedme_personal_lr=personal_lr)
    model = TwoLayerModel()
    runtime = client_runtime(model, config, tmp_path / "state")
    received = offset(model.trainable().tensors, 1, 0.2)  # w^t of round 2
    kept = {n: t.clone() for n, t in received.items()}
    sent, stats = PFedMeClient().train(runtime, received, 2)
    theta = runtime.store.load(before=3)
    assert list(sent) == list(NAMES) and theta is not None and set(theta) == set(NAMES)
    plr = personal_lr or config.lr
    w_hand, theta_hand = _hand_pfedme(kept, config, runtime.seed(2), lam, k, plr)
    assert _close(sent, w_hand) and _close(theta, theta_hand)
    assert all(torch.equal(received[n], kept[n]) for n in NAMES)  # the message is untouched
    # theta is warm-started across batches (not reset to w): with a loose inner solve (few
    # steps, small personal_lr lambda) resetting it is visibly different.
    _, reset = _hand_pfedme(kept, config, runtime.seed(2), lam, k, plr, reset_theta=True)
    if k < 5:
        assert max((theta[n] - reset[n]).abs().max().item() for n in NAMES) > 1e-4
    # w moved, and differently from theta.
    assert max((sent[n] - kept[n]).abs().max().item() for n in NAMES) > 1e-4
    assert max((sent[n] - theta[n]).abs().max().item() for n in NAMES) > 1e-4
    assert stats.num_steps == 6 and stats.examples_seen == 44  # batches, each counted once


def test_lambda_zero_leaves_w_at_the_received_model_and_theta_plain_sgd(tmp_path: Path) -> None:
    config = _config(pfedme_lambda=0.0, pfedme_inner_steps=2, local_epochs=1)
    model = TwoLayerModel()
    runtime = client_runtime(model, config, tmp_path)
    received = offset(model.trainable().tensors, 3, 0.2)
    sent, _ = PFedMeClient().train(runtime, received, 1)
    assert all(torch.equal(sent[n], received[n]) for n in NAMES)
    # theta: plain SGD from w^t, K steps on each batch.
    _, theta = _hand_pfedme(received, config, runtime.seed(1), 0.0, 2, config.lr)
    assert _close(runtime.store.load(before=2), theta)


def test_theta_is_kept_for_that_client_restored_and_evaluated_alone(tmp_path: Path) -> None:
    config = _config(pfedme_lambda=5.0)
    initial, received, sent, _, restarted = kept_personal_model(
        PFedMeClient, config, tmp_path / "state"
    )
    # Another client's store holds nothing: it evaluates w^0, not this client's theta.
    other = client_runtime(TwoLayerModel(), config, tmp_path / "other")
    evaluated = capture_evaluated(other)
    PFedMeClient().evaluate(other, received, 1)
    assert all(torch.equal(evaluated[n], initial[n]) for n in NAMES)
    # Round 2 starts from the received model, not from the saved theta (Algorithm 1).
    PFedMeClient().train(restarted, sent, 2)
    _, expected = _hand_pfedme(sent, config, restarted.seed(2), 5.0, 5, config.lr)
    assert _close(restarted.store.load(before=3), expected)


# ----------------------------------------------------------------------------- the server


def _replies(names: list[str], sizes: tuple[int, ...]) -> list[ClientReply]:
    generator = torch.Generator().manual_seed(0)
    return [
        ClientReply(c, c, {n: torch.randn(2, 3, generator=generator) for n in names}, size, {})
        for c, size in enumerate(sizes)
    ]


@pytest.mark.parametrize("beta", [1.0, 2.0, 0.5])
def test_the_server_beta_step_matches_a_hand_computation(beta: float) -> None:
    groups = {"body.weight": "adapter", "head.weight": "head"}
    start = {n: torch.full((2, 3), 0.5) + i for i, n in enumerate(groups)}
    initial = TrainableTensors(dict(start), groups)
    config = ExperimentConfig(method="pfedme").replace(pfedme_beta=beta)
    strategy = PFedMeStrategy(config, initial)
    replies = _replies(list(groups), (10, 30, 1))
    strategy.aggregate(1, replies)
    total = sum(r.num_examples for r in replies)
    for name in groups:
        # The house FedAvg's mean: weighted by training examples.
        mean = sum(r.arrays[name].double() * r.num_examples for r in replies) / total
        expected = (1 - beta) * start[name].double() + beta * mean
        assert torch.allclose(strategy.global_tensors[name].double(), expected, atol=1e-6), name
    # beta = 1 is FedAvg's result bit for bit.
    if beta == 1.0:
        fedavg = FedAvgStrategy(ExperimentConfig(method="fedavg"), TrainableTensors(start, groups))
        fedavg.aggregate(1, replies)
        assert all(
            torch.equal(strategy.global_tensors[n], fedavg.global_tensors[n]) for n in groups
        )
    # A second round steps from the new global model.
    previous = {n: t.clone() for n, t in strategy.global_tensors.items()}
    strategy.aggregate(2, replies[:1])
    for name in groups:
        expected = (1 - beta) * previous[name].double() + beta * replies[0].arrays[name].double()
        assert torch.allclose(strategy.global_tensors[name].double(), expected, atol=1e-6)


def test_settings_defaults_rules_and_spec() -> None:
    settings = PFedMeSettings()
    assert (settings.lambda_, settings.inner_steps, settings.personal_lr, settings.beta) == (
        15.0,
        5,
        0.0,
        1.0,
    )
    assert PFedMeSettings.keys() == (
        "pfedme-lambda",
        "pfedme-inner-steps",
        "pfedme-personal-lr",
        "pfedme-beta",
    )
    assert settings.personal_step(0.02) == 0.02
    assert settings.replace(personal_lr=0.1).personal_step(0.02) == 0.1
    for key, bad in (("pfedme-lambda", -1.0), ("pfedme-inner-steps", 0), ("pfedme-beta", 0.0)):
        with pytest.raises(ConfigError, match=key):
            ExperimentConfig.from_run_config({"method": "pfedme", key: bad})
    config = ExperimentConfig.from_run_config({"method": "pfedme", "pfedme-lambda": "20"})
    assert config.method_settings == PFedMeSettings(lambda_=20.0)
    spec = method_spec("pfedme")
    assert spec.strategy == "strategies.pfedme:PFedMeStrategy" and spec.tuner == "lora"
    assert spec.capabilities == AVERAGE_ONLY
    assert spec.profile == ResourceProfile(copies=2, passes=5)
    assert spec.search == {"pfedme-lambda": LogUniform(5.0, 50.0), "pfedme-beta": Uniform(1.0, 2.0)}


# ----------------------------------------------------------------------------- end to end


def test_a_run_finishes_and_evaluates_the_personalized_models(
    small_run_config: dict, tmp_path: Path
) -> None:
    records = {}
    for method in ("fedavg", "pfedme"):
        config = {
            **small_run_config,
            "method": method,
            "pfedme-lambda": 15.0,
            "pfedme-beta": 2.0,
            "run-name": method,
            "client-state-dir": str(tmp_path / "state" / method),
        }
        summary, _ = run_in_process(config, num_nodes=4)
        records[method] = RunDirectory(Path(config["output-dir"]) / summary["run-name"]).rounds()
    assert summary["rounds"] == 2
    assert set(summary["final-per-client-accuracy"]) == {"0", "1", "2", "3"}
    assert 0.0 <= summary["final-test-accuracy-mean"] <= 1.0
    assert [r["evaluate"] for r in records["pfedme"]] != [r["evaluate"] for r in records["fedavg"]]
    clients = sorted((tmp_path / "state" / "pfedme" / "pfedme").iterdir())
    assert [c.name for c in clients] == [f"client_{i}" for i in range(4)]
    assert all((c / "round_00002.safetensors").is_file() for c in clients)
