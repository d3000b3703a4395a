"""Local train and evaluate loops shared by every method.

The loops work on ``TensorDataset``s held in memory (the datasets of this framework are
prepared tensors), draw batches from a ``torch.Generator`` seeded per (seed, client, round) so a
round can be replayed exactly, and only step the parameters they are given: the frozen backbone
is never touched.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedfm_flower.config import ExperimentConfig


@dataclass(frozen=True)
class TrainStats:
    """What one local training call did."""

    loss: float
    accuracy: float
    num_examples: int
    num_steps: int
    seconds: float


@dataclass(frozen=True)
class EvalStats:
    """Loss and accuracy of a model on a dataset."""

    loss: float
    accuracy: float
    num_examples: int


def round_seed(seed: int, client_id: int, server_round: int, salt: int = 0) -> int:
    """A deterministic 63-bit seed for one client's work in one round."""
    value = (seed * 1_000_003 + client_id) * 1_000_033 + server_round * 7919 + salt
    return value % (2**63 - 1)


def make_optimizer(
    params: Iterable[nn.Parameter], config: ExperimentConfig
) -> torch.optim.Optimizer:
    """The configured optimizer (sgd, adam or adamw) over ``params``."""
    params = list(params)
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def _batches(
    data: TensorDataset, batch_size: int, generator: torch.Generator | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    images, labels = data.tensors
    n = len(labels)
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    for start in range(0, n, batch_size):
        index = order[start : start + batch_size]
        yield images[index], labels[index]


def train(
    model: nn.Module,
    data: TensorDataset,
    params: Iterable[nn.Parameter],
    config: ExperimentConfig,
    *,
    seed: int,
    epochs: int | None = None,
    steps: int | None = None,
    device: torch.device | None = None,
) -> TrainStats:
    """Train ``params`` of ``model`` on ``data`` with cross-entropy for epochs or steps.

    ``steps`` (when > 0) wins over ``epochs``; both default to the config's local-steps and
    local-epochs. Only ``params`` get gradients; everything else keeps ``requires_grad`` as is.
    """
    params = list(params)
    if epochs is None:
        epochs = config.local_epochs
    if steps is None:
        steps = config.local_steps
    device = device or next(model.parameters()).device
    started = time.perf_counter()
    if not params or len(data) == 0 or (epochs <= 0 and steps <= 0):
        return TrainStats(0.0, 0.0, 0, 0, 0.0)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout and other in-model randomness
    trainable = {id(p) for p in params}
    saved_flags = {name: p.requires_grad for name, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    optimizer = make_optimizer(params, config)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    total_loss, correct, seen, done = 0.0, 0, 0, 0
    try:
        while True:
            for images, labels in _batches(data, config.batch_size, generator):
                images, labels = images.to(device), labels.to(device)
                optimizer.zero_grad(set_to_none=True)
                logits = model(images)
                loss = loss_fn(logits, labels)
                loss.backward()
                optimizer.step()
                total_loss += loss.item() * len(labels)
                correct += (logits.argmax(1) == labels).sum().item()
                seen += len(labels)
                done += 1
                if steps > 0 and done >= steps:
                    break
            epochs -= 1
            if (steps > 0 and done >= steps) or (steps <= 0 and epochs <= 0):
                break
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(saved_flags[name])
    return TrainStats(
        total_loss / max(seen, 1),
        correct / max(seen, 1),
        seen,
        done,
        time.perf_counter() - started,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, data: TensorDataset, batch_size: int = 256, device: torch.device | None = None
) -> EvalStats:
    """Mean cross-entropy and accuracy of ``model`` on ``data``."""
    device = device or next(model.parameters()).device
    model.eval()
    total_loss, correct, seen = 0.0, 0, 0
    for images, labels in _batches(data, batch_size, None):
        images, labels = images.to(device), labels.to(device)
        logits = model(images)
        total_loss += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
        seen += len(labels)
    return EvalStats(total_loss / max(seen, 1), correct / max(seen, 1), seen)
