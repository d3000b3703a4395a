"""Hand-written local loops for methods whose step is not one optimizer step (APFL, Per-FedAvg,
pFedMe).

``fedfm_flower.tasks.training.train`` steps one set of parameters with the configured optimizer;
APFL and Per-FedAvg take gradients at other points than the model's own parameters (a mixture
of two models, a model after an inner step) and apply them by hand with plain SGD, as their
papers and the FedPerfix authors' code do. What they share is here: the model called with
some parameters replaced (``torch.func.functional_call``, no second model in memory), the
seeded batch stream of the local schedule, and the tally of the training statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedfm_flower.tasks.base import Batch, StepResult, Task
from fedfm_flower.tasks.training import StepTally, TrainStats

if TYPE_CHECKING:
    from client_apps.base import ClientRuntime


class WithTensors:
    """``model`` called with the tensors named in ``tensors`` in place of its parameters."""

    def __init__(self, model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
        self.model = model
        self.tensors = dict(tensors)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output with the replaced parameters (gradients flow into them)."""
        return torch.func.functional_call(self.model, self.tensors, args, kwargs)


@contextmanager
def trainable_only(model: nn.Module, params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Train mode with gradients for ``params`` only; the flags are restored afterwards."""
    wanted = {id(p) for p in params}
    saved = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in saved:
        p.requires_grad_(id(p) in wanted)
    model.train()
    try:
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def sgd_(tensors: Iterable[torch.Tensor], grads: Iterable[torch.Tensor], lr: float) -> None:
    """In place: every tensor minus ``lr`` times its gradient (plain SGD)."""
    with torch.no_grad():
        for tensor, grad in zip(tensors, grads, strict=True):
            tensor.sub_(grad, alpha=lr)


def batch_stream(
    task: Task, data: Any, batch_size: int, seed: int, *, epochs: int, steps: int
) -> Iterator[Batch]:
    """Batches in a seeded order: ``steps`` of them when > 0, else ``epochs`` passes."""
    if len(data) == 0 or (epochs <= 0 and steps <= 0):
        return
    generator = torch.Generator().manual_seed(seed)
    done = 0
    while True:
        for batch in task.batches(data, batch_size, generator):
            yield batch
            done += 1
            if steps > 0 and done >= steps:
                return
        epochs -= 1
        if steps <= 0 and epochs <= 0:
            return


def halves(batch: Batch) -> tuple[Batch, Batch]:
    """The first and second half of a batch (a batch of one example is both halves)."""
    size = len(batch[0])
    if size < 2:
        return batch, batch
    cut = (size + 1) // 2
    return tuple(t[:cut] for t in batch), tuple(t[cut:] for t in batch)


def run_loop(
    batches: Iterable[Batch],
    step: Callable[[Batch], Iterable[StepResult]],
    device: torch.device,
    seed: int,
) -> TrainStats:
    """Call ``step`` on every batch (moved to ``device``); tally the step results it returns."""
    tally = StepTally()
    torch.manual_seed(seed)  # dropout and other in-model randomness
    for batch in batches:
        for result in step(tuple(t.to(device) for t in batch)):
            tally.add(result)
        tally.steps += 1
    return tally.stats()


def local_schedule(
    runtime: ClientRuntime,
    model: nn.Module,
    params: Iterable[nn.Parameter],
    step: Callable[[Batch], Iterable[StepResult]],
    server_round: int,
    batch_size: int | None = None,
) -> TrainStats:
    """Run ``step`` over the round's seeded batches of the run's local schedule (``batch_size``,
    by default the run's) with only ``params`` trainable; the tallied statistics."""
    config = runtime.config
    seed = runtime.seed(server_round)
    batches = batch_stream(
        runtime.task,
        runtime.data.train,
        batch_size or config.batch_size,
        seed,
        epochs=config.local_epochs,
        steps=config.local_steps,
    )
    with trainable_only(model, params):
        return run_loop(batches, step, runtime.device, seed)
