"""FedRoD (Chen & Chao 2022): the balanced softmax, the client's step against a hand-written loop,
the personal head's life on its client, and an end-to-end run (``client_apps.fedrod``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from torch import nn

from client_apps.fedrod import (
    PERSONAL_BIAS,
    PERSONAL_WEIGHT,
    FedRoDClient,
    PersonalHead,
    PersonalizedClassifier,
    balanced_softmax_loss,
    class_counts,
    generic_head,
)
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods import registry
from fedfm_flower.methods.fedrod import FedRoDSettings
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import record_names
from fedfm_flower.tasks.classification import ImageClassification
from fedfm_flower.tasks.training import evaluate
from server_apps.inprocess import run_in_process
from strategies.fedavg import FedAvgStrategy
from tests.tiny_clients import CLASSES, IN, TwoLayerModel, client_runtime, data

BODY = ("body.weight", "body.bias")
HEAD = ("head.weight", "head.bias")


def _config(**changes: object) -> ExperimentConfig:
    """Plain SGD, so a step is ``w - lr * grad``."""
    base = ExperimentConfig(method="fedrod", lr=0.3, batch_size=4, momentum=0.0, weight_decay=0.0)
    return base.replace(**changes)


# ----------------------------------------------------------------------------- (a) the loss


def _bsm_by_hand(logits: np.ndarray, labels: np.ndarray, counts: np.ndarray) -> float:
    """Balanced softmax in numpy: the softmax over the client's classes only, of logits +
    log counts (a class it lacks is left out)."""
    present = counts > 0
    losses = []
    for row, label in zip(logits, labels, strict=True):
        adjusted = row[present] + np.log(counts[present])
        target = row[label] + np.log(counts[label])
        top = adjusted.max()
        losses.append(-(target - top - np.log(np.exp(adjusted - top).sum())))
    return float(np.mean(losses))


def test_balanced_softmax_matches_a_numpy_computation_and_drops_absent_classes() -> None:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 1, 3, 3, 0, 1])
    counts = class_counts(torch.tensor([0, 0, 0, 1, 3, 3, 3, 3, 1]), 4)  # class 2: none
    assert counts.tolist() == [3, 2, 0, 4]
    loss = balanced_softmax_loss(logits, labels, counts)
    expected = _bsm_by_hand(logits.detach().numpy(), labels.numpy(), counts.numpy())
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[:, 2], torch.zeros(6, dtype=torch.float64))  # no gradient at all
    # The same as the plain cross-entropy over the present classes' adjusted logits.
    keep = [0, 1, 3]
    shifted = logits[:, keep] + counts[keep].double().log()
    plain = nn.functional.cross_entropy(shifted, torch.tensor([0, 1, 2, 2, 0, 1]))
    assert loss.item() == pytest.approx(plain.item(), abs=1e-12)
    # With equal counts it is the plain cross-entropy (log n shifts every logit alike).
    even = balanced_softmax_loss(logits, labels, torch.full((4,), 5))
    assert even.item() == pytest.approx(nn.functional.cross_entropy(logits, labels).item())


def test_class_counts_refuse_a_label_outside_the_head() -> None:
    with pytest.raises(ValueError, match="outside the 3 classes"):
        class_counts(torch.tensor([0, 3]), 3)


# ----------------------------------------------------------------------------- (b) the step


def _hand_round(
    start: dict[str, torch.Tensor],
    personal: tuple[torch.Tensor, torch.Tensor],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    counts: torch.Tensor,
    lr: float,
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """FedRoD's local round in plain torch: per batch, the body and h_G step on the balanced
    softmax alone; h_P on the cross-entropy of h_G(z) + h_P(z), its gradient by hand with z
    and h_G(z) taken as constants."""
    w = {n: t.clone() for n, t in start.items()}
    w_p, b_p = (t.clone() for t in personal)
    present = counts > 0
    log_counts = torch.log(counts[present].double()).float()
    for x, y in batches:
        leaves = {n: t.clone().requires_grad_() for n, t in w.items()}
        z = torch.tanh(x @ leaves["body.weight"].T + leaves["body.bias"])
        z_g = z @ leaves["head.weight"].T + leaves["head.bias"]
        adjusted = z_g[:, present] + log_counts  # class 2 is absent from this client
        index = torch.cumsum(present.long(), 0)[y] - 1  # each label's column among the present
        picked = adjusted.gather(1, index[:, None]).squeeze(1)
        bsm = (torch.logsumexp(adjusted, 1) - picked).mean()
        grads = dict(zip(leaves, torch.autograd.grad(bsm, list(leaves.values())), strict=True))
        z, z_g = z.detach(), z_g.detach()
        probs = torch.softmax(z_g + z @ w_p.T + b_p, 1)
        residual = (probs - nn.functional.one_hot(y, CLASSES)) / len(y)
        g_w, g_b = residual.T @ z, residual.sum(0)
        w = {n: w[n] - lr * grads[n] for n in w}
        w_p, b_p = w_p - lr * g_w, b_p - lr * g_b
    return w, (w_p, b_p)


def test_a_client_round_matches_a_hand_written_loop(tmp_path: Path) -> None:
    model = TwoLayerModel("adapter")
    config = _config()
    runtime = client_runtime(model, config, tmp_path, train=data(10, 1, classes=2))
    strategy = FedAvgStrategy(config, model.trainable())
    received = {n: t + 0.05 for n, t in strategy.train_payload(0, 1).items()}
    assert set(received) == {*BODY, *HEAD}  # the body and h_G travel
    initial_head = (model.head.weight.detach().clone(), model.head.bias.detach().clone())

    sent, stats = FedRoDClient().train(runtime, received, 1)
    assert stats.num_steps == 3 and stats.examples_seen == 10  # batches of 4, 4, 2

    generator = torch.Generator().manual_seed(runtime.seed(1))
    batches = list(runtime.task.batches(runtime.data.train, 4, generator))
    counts = class_counts(runtime.data.train.tensors[1], CLASSES)
    assert counts[2] == 0
    expected, (w_p, b_p) = _hand_round(received, initial_head, batches, counts, config.lr)
    assert set(sent) == {*BODY, *HEAD}
    for name in sent:
        assert torch.allclose(sent[name], expected[name], atol=1e-6), name
    saved = runtime.store.load(before=2)
    assert saved is not None and set(saved) == {PERSONAL_WEIGHT, PERSONAL_BIAS}
    assert torch.allclose(saved[PERSONAL_WEIGHT], w_p, atol=1e-6)
    assert torch.allclose(saved[PERSONAL_BIAS], b_p, atol=1e-6)
    # The personal loss moved h_P, and none of it reached the body or h_G: the same round with
    # h_P ten times larger sends the same tensors.
    assert not torch.allclose(w_p, initial_head[0])
    other = client_runtime(
        TwoLayerModel("adapter"), config, tmp_path / "other", train=data(10, 1, classes=2)
    )
    other.store.save(0, {PERSONAL_WEIGHT: 10 * w_p, PERSONAL_BIAS: 10 * b_p})
    resent, _ = FedRoDClient().train(other, received, 1)
    assert all(torch.equal(resent[n], sent[n]) for n in sent)


# --------------------------------------------------------------- (c) the personal head's life


def test_the_personal_head_stays_on_its_client_and_persists_across_rounds(
    tmp_path: Path,
) -> None:
    model = TwoLayerModel("adapter")
    config = _config()
    runtime = client_runtime(model, config, tmp_path / "state", train=data(10, 1, classes=2))
    received = FedAvgStrategy(config, model.trainable()).train_payload(0, 1)
    initial_head = {n: model.get_parameter(n).detach().clone() for n in HEAD}

    # Its first value: the head's seeded initial values (fedrod-personal-init = initial).
    first = FedRoDClient().personal(runtime, runtime.model(), {"before": 1})
    assert torch.equal(first.weight.detach(), initial_head["head.weight"])
    assert torch.equal(first.bias.detach(), initial_head["head.bias"])

    sent, _ = FedRoDClient().train(runtime, received, 1)
    assert not any(n.startswith("fedrod-") for n in sent)
    after_one = runtime.store.load(before=2)
    assert after_one is not None
    # Round 3 (the client sat out round 2) starts from round 1's h_P, even after a restart
    # (a fresh context: the memory state is empty, the disk has it).
    restarted = client_runtime(
        TwoLayerModel("adapter"),
        config,
        tmp_path / "state",
        state=RecordDict(),
        train=data(10, 1, classes=2),
    )
    resumed = FedRoDClient().personal(restarted, restarted.model(), {"before": 3})
    assert torch.equal(resumed.weight.detach(), after_one[PERSONAL_WEIGHT])
    sent_three, _ = FedRoDClient().train(restarted, sent, 3)
    assert set(sent_three) == set(sent)
    after_three = restarted.store.load(before=4)
    assert after_three is not None and restarted.store.rounds() == [1, 3]
    assert not torch.equal(after_three[PERSONAL_WEIGHT], after_one[PERSONAL_WEIGHT])
    # Evaluation uses the newest h_P at or before its round and saves nothing.
    evaluated = FedRoDClient().personal(restarted, restarted.model(), {"at_most": 2})
    assert torch.equal(evaluated.weight.detach(), after_one[PERSONAL_WEIGHT])
    FedRoDClient().evaluate(restarted, sent_three, 3)
    assert restarted.store.rounds() == [1, 3]


# ------------------------------------------------------- (d) predictions and the evaluation


def test_a_zero_personal_head_predicts_as_the_generic_head(tmp_path: Path) -> None:
    model = TwoLayerModel("adapter")
    x = torch.randn(7, IN, generator=torch.Generator().manual_seed(3))
    head = generic_head(model)
    zero = PersonalHead(torch.zeros_like(head.weight), torch.zeros_like(head.bias))
    with torch.no_grad():
        assert torch.equal(PersonalizedClassifier(model, zero)(x), model(x))

    config = _config().replace(fedrod_personal_init="zeros")
    runtime = client_runtime(model, config, tmp_path, train=data(10, 1, classes=2))
    received = FedAvgStrategy(config, model.trainable()).train_payload(0, 1)
    stats = FedRoDClient().evaluate(runtime, received, 1)  # before any training: h_P = 0
    plain = evaluate(ImageClassification(), runtime.model(), runtime.data.test)
    assert stats.metrics["accuracy"] == stats.metrics["generic-accuracy"]
    assert stats.metrics["accuracy"] == plain.metrics["accuracy"]
    assert stats.loss == pytest.approx(plain.loss, abs=1e-6)


def test_evaluation_reports_personalized_and_generic_accuracy(tmp_path: Path) -> None:
    model = TwoLayerModel("adapter")
    config = _config(lr=1.0)
    runtime = client_runtime(model, config, tmp_path, train=data(10, 1, classes=2))
    received = FedAvgStrategy(config, model.trainable()).train_payload(0, 1)
    sent, _ = FedRoDClient().train(runtime, received, 1)
    stats = FedRoDClient().evaluate(runtime, sent, 1)
    saved = runtime.store.load(at_most=1)
    assert saved is not None
    fresh = runtime.model()
    fresh.load_tensors(sent)
    x, y = runtime.data.test.tensors
    with torch.no_grad():
        generic = fresh(x)
        z = torch.tanh(fresh.body(x))
        personalized = generic + z @ saved[PERSONAL_WEIGHT].T + saved[PERSONAL_BIAS]
    expected_personal = (personalized.argmax(1) == y).float().mean().item()
    expected_generic = (generic.argmax(1) == y).float().mean().item()
    assert stats.metrics["accuracy"] == pytest.approx(expected_personal)
    assert stats.metrics["generic-accuracy"] == pytest.approx(expected_generic)
    loss = nn.functional.cross_entropy(personalized, y).item()
    assert stats.loss == pytest.approx(loss, abs=1e-6) and stats.num_examples == 9


# ----------------------------------------------------------------------------- settings


def test_fedrod_settings_and_spec() -> None:
    assert FedRoDSettings().personal_init == "initial"
    config = ExperimentConfig.from_run_config({"method": "fedrod", "fedrod-personal-init": "zeros"})
    assert config.method_settings == FedRoDSettings(personal_init="zeros")
    with pytest.raises(ConfigError, match="fedrod-personal-init"):
        ExperimentConfig.from_run_config({"method": "fedrod", "fedrod-personal-init": "random"})
    spec = registry.method_spec("fedrod")
    assert spec.search == {}  # only the common training keys are tuned
    resolved = registry.resolve(ExperimentConfig(method="fedrod"))
    assert (resolved.tuner, resolved.trains_backbone) == ("lora", False)
    whole = ExperimentConfig(method="fedrod", tuner="none", train_backbone=True)
    assert registry.trains_backbone(whole) and registry.tuner_of(whole) == "none"


# ----------------------------------------------------------------------------- (f) refusal


@pytest.mark.parametrize(
    ("dataset", "backbone"), [("instructions", "tiny-llama"), ("multitask", "mm-offline")]
)
def test_a_non_classification_run_is_refused_in_one_line(dataset: str, backbone: str) -> None:
    with pytest.raises(ConfigError) as info:
        ExperimentConfig.from_run_config(
            {"method": "fedrod", "dataset": dataset, "backbone": backbone}
        )
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("run config 'method' = 'fedrod' is invalid: it serves image models")


def test_a_model_without_a_linear_head_is_refused_naming_the_method() -> None:
    with pytest.raises(TypeError, match="method 'fedrod' needs a model with a linear"):
        generic_head(nn.Sequential(nn.Linear(2, 2)))


# ----------------------------------------------------------------------------- (e) end to end


def test_fedrod_runs_end_to_end_and_keeps_personal_heads_home(
    small_run_config: dict, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    config = {**small_run_config, "method": "fedrod", "client-state-dir": str(tmp_path / "st")}
    summary, grid = run_in_process(config, num_nodes=4)
    assert summary["rounds"] == 2
    assert 0.2 < summary["final-test-accuracy-mean"] <= 1.0  # chance is 0.1
    assert set(summary["final-per-client-accuracy"]) == {"0", "1", "2", "3"}
    run_dir = Path(config["output-dir"]) / summary["run-name"]
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    for record in rounds:
        generic = record["test-generic-accuracy-mean"]  # h_G alone, beside h_G + h_P
        assert 0.0 <= generic <= 1.0 and not math.isnan(generic)
    heads = {}
    for client_dir in sorted((tmp_path / "st" / summary["run-name"]).iterdir()):
        files = sorted(client_dir.glob("round_*.safetensors"))
        saved = load_file(files[-1])
        assert set(saved) == {PERSONAL_WEIGHT, PERSONAL_BIAS}
        heads[client_dir.name] = saved[PERSONAL_WEIGHT]
    assert len(heads) == 4
    values = list(heads.values())
    assert all(not torch.equal(values[0], other) for other in values[1:])
    for message in grid.sent:  # no personal head ever left or reached a client
        arrays = message.content.array_records.get(P.ARRAYS)
        names = record_names(arrays) if arrays is not None else []
        assert not any(n.startswith("fedrod-") for n in names)
        if message.metadata.message_type == "train":
            assert any(n.startswith("head.") for n in names)  # h_G travels
