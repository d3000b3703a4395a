"""Tiny models and a client runtime on hand-made data, for tests of a method's client half
checked against hand computations (FedPerfix's Table 2 baselines, Ditto, FedRoD), and a
written-out Adam step (the hypernetwork baselines' servers)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from flwr.app import RecordDict
from torch import nn
from torch.utils.data import TensorDataset

from client_apps.base import ClientRuntime
from fedfm_flower.config.experiment import ExperimentConfig, NodeIdentity
from fedfm_flower.methods import registry
from fedfm_flower.models.groups import GroupPattern, TunedModel
from fedfm_flower.records.client_state import ClientStateStore
from fedfm_flower.tasks.classification import ImageClassification
from fedfm_flower.tasks.training import EvalStats

IN, HIDDEN, CLASSES = 4, 5, 3
TWO_LAYER_NAMES = ("body.weight", "body.bias", "head.weight", "head.bias")


class LinearModel(TunedModel):
    """logits = x W^T + b: one Linear, group ``head``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(IN, CLASSES)
        self.group_patterns = (GroupPattern("head", r"^head\."),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


class TwoLayerModel(TunedModel):
    """A body (group ``body_group``: ``vit.mlp``, FedBABU's split; ``adapter``, a tuner's) and
    a linear head."""

    def __init__(self, body_group: str = "vit.mlp") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.group_patterns = (
            GroupPattern(body_group, r"^body\."),
            GroupPattern("head", r"^head\."),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def data(n: int, seed: int, classes: int = CLASSES) -> TensorDataset:
    """``n`` seeded examples of ``IN`` features, labels among the first ``classes``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=generator)
    return TensorDataset(x, torch.randint(0, classes, (n,), generator=generator))


def client_runtime(
    model: TunedModel,
    config: ExperimentConfig,
    state_dir: Path,
    state: RecordDict | None = None,
    train: TensorDataset | None = None,
) -> ClientRuntime:
    """A client runtime on ``model`` (reset to its initial tensors per message), hand-made
    data (``train``, by default 22 examples of seed 1; 9 test examples of seed 2) and a state
    store on disk."""
    store = ClientStateStore(state or RecordDict(), 0, "run", str(state_dir))
    device = torch.device("cpu")
    runtime = ClientRuntime(config, NodeIdentity(0, 0, 2), store, device, registry.resolve(config))
    initial = dict(model.trainable().tensors)

    def fresh() -> TunedModel:
        model.load_tensors(initial)
        return model

    runtime.model = fresh  # type: ignore[method-assign]
    runtime.__dict__["task"] = ImageClassification()
    train = data(22, 1) if train is None else train
    runtime.__dict__["data"] = SimpleNamespace(train=train, test=data(9, 2))
    return runtime


def capture_evaluated(runtime: ClientRuntime) -> dict[str, torch.Tensor]:
    """Make ``runtime.evaluate`` record the trainable tensors of the model it evaluates."""
    seen: dict[str, torch.Tensor] = {}

    def evaluate(model: TunedModel) -> EvalStats:
        seen.update(model.trainable().tensors)
        return ClientRuntime.evaluate(runtime, model)

    runtime.evaluate = evaluate  # type: ignore[method-assign]
    return seen


def ce_grads(
    weight: torch.Tensor, bias: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """By hand: the gradient of the mean cross-entropy of logits = x W^T + b."""
    x, y = batch
    residual = (
        torch.softmax(x @ weight.T + bias, dim=1) - nn.functional.one_hot(y, CLASSES)
    ) / len(y)
    return residual.T @ x, residual.sum(0)


def offset(tensors: dict[str, torch.Tensor], seed: int, scale: float) -> dict[str, torch.Tensor]:
    """``tensors`` each moved by ``scale`` times seeded standard-normal noise."""
    generator = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=generator) for n, t in tensors.items()}


def two_layer_grads(
    params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """By hand: the gradient of the mean cross-entropy of head(tanh(body(x))) at ``params``
    (``TwoLayerModel``'s tensors, in ``TWO_LAYER_NAMES`` order)."""
    leaves = {n: t.clone().requires_grad_() for n, t in params.items()}
    hidden = torch.tanh(x @ leaves["body.weight"].T + leaves["body.bias"])
    logits = hidden @ leaves["head.weight"].T + leaves["head.bias"]
    loss = nn.functional.cross_entropy(logits, y)
    return torch.autograd.grad(loss, [leaves[n] for n in TWO_LAYER_NAMES])


def hand_adam(value: torch.Tensor, grad: torch.Tensor, state: dict, lr: float) -> torch.Tensor:
    """One Adam step (betas 0.9, 0.999, eps 1e-8) of ``value`` from ``state`` (torch's
    ``exp_avg``, ``exp_avg_sq``, ``step``; empty: the first step), written out."""
    t = int(state["step"]) + 1 if state else 1
    m = (0.9 * state["exp_avg"] if state else 0) + 0.1 * grad
    v = (0.999 * state["exp_avg_sq"] if state else 0) + 0.001 * grad * grad
    m_hat, v_hat = m / (1 - 0.9**t), v / (1 - 0.999**t)
    return value - lr * m_hat / (v_hat.sqrt() + 1e-8)


def kept_personal_model(client: type, config: ExperimentConfig, state_dir: Path) -> tuple:
    """One round of ``client`` (a client half that keeps a personal model in its client state:
    Ditto's v, pFedMe's theta), checked as every such half must behave: before its first round
    it evaluates the model's initial values; after it, its store holds on disk a personal model
    that is not what it sent; a restarted runtime (empty memory) evaluates that stored model
    whatever global model arrives. Returns (initial, received, sent, personal, restarted)."""
    model = TwoLayerModel()
    runtime = client_runtime(model, config, state_dir)
    initial = model.trainable().tensors
    received = offset(initial, 6, 0.1)
    evaluated = capture_evaluated(runtime)
    client().evaluate(runtime, received, 0)
    assert all(torch.equal(evaluated[n], initial[n]) for n in TWO_LAYER_NAMES)
    sent, _ = client().train(runtime, received, 1)
    assert runtime.store.rounds() == [1]
    personal = runtime.store.load(before=2)
    assert not any(torch.equal(personal[n], sent[n]) for n in TWO_LAYER_NAMES)
    assert (state_dir / "run" / "client_0" / "round_00001.safetensors").is_file()
    restarted = client_runtime(TwoLayerModel(), config, state_dir, state=RecordDict())
    evaluated = capture_evaluated(restarted)
    client().evaluate(restarted, offset(received, 7, 5.0), 1)
    assert all(torch.equal(evaluated[n], personal[n]) for n in TWO_LAYER_NAMES)
    return initial, received, sent, personal, restarted
