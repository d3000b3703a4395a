"""The client half of Per-FedAvg (Fallah et al. 2020), first-order version (FO-MAML).

Every trainable tensor the client owns (the meta-model w: the whole ViT, or on TAP's
multi-task model the components of the client's modality-task pairs) comes from the server and
goes back. A local step
takes two batches D and D' (the two halves of a batch of twice ``batch-size``, as the FedPerfix
authors' code loads them) and does

    temp = w - alpha * grad f(w; D)
    w   <- w - beta * grad f(temp; D')      (the gradient at temp, applied to w)

with plain SGD (the optimizer, momentum and weight-decay keys do not apply). ``temp`` is
evaluated through ``torch.func.functional_call`` on the one cached model. Before each
evaluation a copy adapts with one step, w - alpha * grad f(w; D) on one batch (``batch-size``)
of the client's train split, and is evaluated; nothing of it is kept. ``perfedavg-alpha`` and
``perfedavg-beta`` default to the run's ``lr`` (``fedfm_flower.methods.perfedavg``).

``per-fedavg-ft`` (TAP's "Per-FedAvg + Post-train") trains the same way and, before each
evaluation, trains a copy of w for the fine-tuning schedule (``finetune-steps``, TAP's P) with
the configured optimizer instead of the one adaptation step. A batch that misses some of the
client's pairs leaves their components' gradients at zero.
"""

from __future__ import annotations

import torch

from client_apps.base import ClientLogic, ClientRuntime
from client_apps.stepwise import (
    WithTensors,
    batch_stream,
    halves,
    local_schedule,
    run_loop,
    sgd_,
    trainable_only,
)
from fedfm_flower.methods.perfedavg import PerFedAvgSettings
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.base import Batch, StepResult, Task
from fedfm_flower.tasks.training import EvalStats, TrainStats


def gradients(loss: torch.Tensor, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """d loss / d tensors, zeros for tensors the loss does not reach (a component whose pair
    is not in the batch)."""
    return torch.autograd.grad(loss, tensors, allow_unused=True, materialize_grads=True)


def adapt_step(
    task: Task, model: TunedModel, w: dict[str, torch.nn.Parameter], batch: Batch, alpha: float
) -> StepResult:
    """w <- w - alpha * grad f(w; batch), in place; the step's result at w."""
    result = task.step(model, batch)
    sgd_(w.values(), gradients(result.loss, list(w.values())), alpha)
    return result


def perfedavg_step(
    task: Task,
    model: TunedModel,
    w: dict[str, torch.nn.Parameter],
    first: Batch,
    second: Batch,
    alpha: float,
    beta: float,
) -> tuple[StepResult, StepResult]:
    """One first-order Per-FedAvg step on w (in place); the results at w on D and at temp on D'."""
    inner = task.step(model, first)
    grads = gradients(inner.loss, list(w.values()))
    with torch.no_grad():
        pairs = zip(w.items(), grads, strict=True)
        temp = {n: (p - alpha * g).requires_grad_() for (n, p), g in pairs}
    outer = task.step(WithTensors(model, temp), second)
    sgd_(w.values(), gradients(outer.loss, list(temp.values())), beta)
    return inner, outer


def _names(runtime: ClientRuntime, model: TunedModel) -> list[str]:
    return model.names_for(runtime.task.holdings(runtime.data))


class PerFedAvgClient(ClientLogic):
    """The meta-model from the server and back; one adaptation step before evaluating."""

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """First-order Per-FedAvg steps over the local schedule; send w."""
        model = runtime.model()
        model.load_tensors(received)
        names = _names(runtime, model)
        w = model.parameters_named(names)
        config = runtime.config
        alpha, beta = config.settings_of(PerFedAvgSettings).steps(config.lr)

        def step(batch: Batch) -> tuple[StepResult, StepResult]:
            first, second = halves(batch)
            return perfedavg_step(runtime.task, model, w, first, second, alpha, beta)

        stats = local_schedule(
            runtime, model, w.values(), step, server_round, 2 * config.batch_size
        )
        # w and, on a model with BatchNorm, the running statistics its steps updated.
        return model.tensors_named(names), stats

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """One adaptation step on a train batch (on the cached model, reset by the next
        message), then evaluate."""
        model = runtime.model()
        model.load_tensors(received)
        w = model.parameters_named(_names(runtime, model))
        config = runtime.config
        alpha, _ = config.settings_of(PerFedAvgSettings).steps(config.lr)
        seed = runtime.seed(server_round, salt=2)
        batches = batch_stream(
            runtime.task, runtime.data.train, config.batch_size, seed, epochs=1, steps=1
        )

        def step(batch: Batch) -> list[StepResult]:
            return [adapt_step(runtime.task, model, w, batch, alpha)]

        with trainable_only(model, w.values()):
            run_loop(batches, step, runtime.device, seed)
        return runtime.evaluate(model)


class PerFedAvgFineTuneClient(PerFedAvgClient):
    """Per-FedAvg; evaluation fine-tunes a copy of w for the fine-tuning schedule first."""

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Train w for ``finetune-steps`` (or ``finetune-epochs``), then evaluate (the cached
        model is reset by the next message)."""
        model = runtime.model()
        model.load_tensors(received)
        runtime.fine_tune(model, _names(runtime, model), server_round)
        return runtime.evaluate(model)
