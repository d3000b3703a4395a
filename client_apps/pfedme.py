"""pFedMe's client (Dinh et al. 2020, Algorithm 1): K inner steps on the personalized theta per
batch, then the outer step of the local w; w is sent, theta kept and evaluated.

The received global model w^t is the local w's start and the model's (theta's) start. On each
batch of the run's local schedule (the round's seeded order): K times on that batch,
theta <- theta - personal_lr (grad f(theta) + lambda (theta - w)) (the gradient of the inner
problem f(theta) + lambda/2 ||theta - w||^2); then w <- w - lr lambda (w - theta). theta is
not reset between batches (the authors' code and PFLlib). Plain SGD throughout (no momentum,
no weight decay). w (every trainable tensor this client owns) is sent; the last theta is saved
in client state and is what evaluation loads, ignoring the received global model. A client
with no saved theta evaluates the model's seeded initial values, the server's w^0. The choices
are in ``fedfm_flower.methods.pfedme``.
"""

from __future__ import annotations

import torch

from client_apps.base import ClientLogic, ClientRuntime
from client_apps.stepwise import local_schedule, sgd_
from fedfm_flower.methods.pfedme import PFedMeSettings
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.base import Batch, StepResult, Task
from fedfm_flower.tasks.training import EvalStats, TrainStats


def pfedme_batch(
    task: Task,
    model: TunedModel,
    theta: dict[str, torch.nn.Parameter],
    w: dict[str, torch.Tensor],
    batch: Batch,
    settings: PFedMeSettings,
    lr: float,
) -> StepResult:
    """One local round on ``batch``: K inner steps on ``theta`` (the model's parameters), then
    the outer step on ``w``, both in place; returns the last inner step's result."""
    personal_lr = settings.personal_step(lr)
    lam = settings.lambda_
    result = None
    for _ in range(settings.inner_steps):
        result = task.step(model, batch)
        grads = torch.autograd.grad(result.loss, list(theta.values()))
        with torch.no_grad():
            steps = [g + lam * (p - w[n]) for (n, p), g in zip(theta.items(), grads, strict=True)]
        sgd_(theta.values(), steps, personal_lr)
    with torch.no_grad():
        for name, p in theta.items():
            w[name].sub_(w[name] - p, alpha=lr * lam)
    assert result is not None  # inner_steps >= 1 (a positive setting)
    return result


class PFedMeClient(ClientLogic):
    """The local w from the server and back; the personalized theta in client state."""

    def personal(
        self, runtime: ClientRuntime, model: TunedModel, names: list[str], lookup: dict
    ) -> dict[str, torch.Tensor]:
        """theta saved per ``lookup``, else ``model``'s tensors (at their initial values: w^0)."""
        saved = runtime.store.load(**lookup)
        return model.tensors_named(names) if saved is None else saved

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """pFedMe's local rounds from ``received``: keep theta, send w."""
        model = runtime.model()
        names = runtime.split(model)[0]  # every trainable tensor this client owns
        model.load_tensors(received)
        theta = model.parameters_named(names)
        w = {n: p.detach().clone() for n, p in theta.items()}
        config = runtime.config
        settings = config.settings_of(PFedMeSettings)

        def step(batch: Batch) -> list[StepResult]:
            return [pfedme_batch(runtime.task, model, theta, w, batch, settings, config.lr)]

        stats = local_schedule(runtime, model, theta.values(), step, server_round)
        kept = model.tensors_named(names)
        runtime.store.save(server_round, kept)
        # w, and the BatchNorm statistics (no parameters: theta's steps updated them) as kept.
        return {n: w[n].cpu() if n in w else kept[n] for n in names}, stats

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Evaluate the latest theta (the received global model is not used)."""
        model = runtime.model()
        names = runtime.split(model)[0]
        model.load_tensors(self.personal(runtime, model, names, {"at_most": server_round}))
        return runtime.evaluate(model)
