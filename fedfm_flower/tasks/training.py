"""Local train and evaluate loops shared by every method and every task.

The loops know nothing of labels or metrics: the task (``fedfm_flower.tasks``) batches the data,
computes each batch's loss and statistics, and evaluates. Batches are drawn from a
``torch.Generator`` seeded per (seed, client, round) so a round can be replayed exactly, and only
the parameters given are stepped: the frozen backbone is never touched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.tasks.base import EvalStats, StepResult, Task, TrainStats

__all__ = [
    "EvalStats",
    "StepTally",
    "TrainStats",
    "evaluate",
    "make_optimizer",
    "round_seed",
    "train",
]


class StepTally:
    """Running totals of a local loop: per-example mean loss and metrics, steps, seconds."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.total_loss = 0.0
        self.seen = 0
        self.steps = 0
        self.sums: dict[str, float] = {}

    def add(self, result: StepResult) -> None:
        """Count one batch result (its loss, statistic sums and examples)."""
        self.total_loss += result.loss.item() * result.count
        for name, value in result.sums.items():
            self.sums[name] = self.sums.get(name, 0) + value
        self.seen += result.count

    def stats(self) -> TrainStats:
        """The loop's statistics so far."""
        seen = max(self.seen, 1)
        return TrainStats(
            self.total_loss / seen,
            {name: value / seen for name, value in self.sums.items()},
            self.seen,
            self.steps,
            time.perf_counter() - self.started,
        )


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


def train(
    task: Task,
    model: nn.Module,
    data: Any,
    params: Iterable[nn.Parameter],
    config: ExperimentConfig,
    *,
    seed: int,
    epochs: int | None = None,
    steps: int | None = None,
    device: torch.device | None = None,
    schedule: Callable[[int], float] | None = None,
    penalty: Callable[[], torch.Tensor] | None = None,
) -> TrainStats:
    """Train ``params`` of ``model`` on ``data`` with the task's loss for epochs or steps.

    ``steps`` (when > 0) wins over ``epochs``; both default to the config's local-steps and
    local-epochs. Only ``params`` get gradients; everything else keeps ``requires_grad`` as is.
    ``schedule`` maps the optimizer step (from 0) to a learning-rate multiplier (none: constant).
    ``penalty`` is added to every batch's loss (FedProx's proximal term); the reported loss is
    the task's alone.
    """
    params = list(params)
    if epochs is None:
        epochs = config.local_epochs
    if steps is None:
        steps = config.local_steps
    device = device or next(model.parameters()).device
    tally = StepTally()
    if not params or len(data) == 0 or (epochs <= 0 and steps <= 0):
        return TrainStats(0.0, {}, 0, 0, 0.0)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout and other in-model randomness
    trainable = {id(p) for p in params}
    saved_flags = {name: p.requires_grad for name, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    optimizer = make_optimizer(params, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule else None
    model.train()
    try:
        while True:
            for batch in task.batches(data, config.batch_size, generator):
                batch = tuple(t.to(device) for t in batch)
                optimizer.zero_grad(set_to_none=True)
                result = task.step(model, batch)
                loss = result.loss if penalty is None else result.loss + penalty()
                loss.backward()
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                tally.add(result)
                tally.steps += 1
                if steps > 0 and tally.steps >= steps:
                    break
            epochs -= 1
            if (steps > 0 and tally.steps >= steps) or (steps <= 0 and epochs <= 0):
                break
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(saved_flags[name])
    return tally.stats()


def proximal_term(
    params: Mapping[str, nn.Parameter], anchor: Mapping[str, torch.Tensor], mu: float
) -> Callable[[], torch.Tensor]:
    """FedProx's (mu / 2) * sum ||w - w_anchor||^2 over ``params`` (Li et al. 2020)."""
    pairs = [(p, anchor[n].to(p.device, p.dtype)) for n, p in params.items()]

    def term() -> torch.Tensor:
        return 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in pairs)

    return term


def evaluate(
    task: Task,
    model: nn.Module,
    data: Any,
    batch_size: int = 256,
    device: torch.device | None = None,
) -> EvalStats:
    """The task's loss and metrics of ``model`` on ``data``."""
    device = device or next(model.parameters()).device
    return task.evaluate(model, data, device, batch_size)
