"""The client half of APFL (Deng et al. 2020, "Adaptive Personalized Federated Learning").

Each client keeps a personal model v_i (every trainable tensor) and a mixing weight alpha_i in
its client state; the global model w (every trainable tensor too) comes from the server and
goes back. On each local batch (the paper's Algorithm 1, all three gradients at the values
before the step, with mixed = alpha v + (1 - alpha) w):

(a) w <- w - lr * grad_w f(w);
(b) v <- v - lr * grad_v f(mixed), w fixed (grad_v f(mixed) = alpha * grad f(mixed));
(c) alpha <- clip(alpha - alpha_lr * d f(mixed) / d alpha, 0, 1), where
    d f / d alpha = <grad f(mixed), v - w>.

The steps are plain SGD with the run's ``lr`` (the optimizer, momentum and weight-decay keys do
not apply), as in the paper and the FedPerfix authors' code. The mixed model is evaluated
through ``torch.func.functional_call`` on the one cached model, so no second model is built.
The personalised model that is evaluated is alpha v + (1 - alpha) w. A client's v starts from
the model's seeded initial values (w's initial values, as the paper's v_i^(0) = w^(0)) and its
alpha from ``apfl-alpha``. The reported training loss and metrics are the mixed model's.
"""

from __future__ import annotations

import torch

from client_apps.base import ClientLogic, ClientRuntime
from client_apps.stepwise import (
    WithTensors,
    local_schedule,
    sgd_,
)
from fedfm_flower.methods.apfl import APFLSettings
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.base import Batch, StepResult, Task
from fedfm_flower.tasks.training import EvalStats, TrainStats

ALPHA_KEY = "apfl-alpha"  # alpha's key in the client state (no parameter name lacks a dot)


def mix(
    v: dict[str, torch.Tensor], w: dict[str, torch.Tensor], alpha: float | torch.Tensor
) -> dict[str, torch.Tensor]:
    """alpha v + (1 - alpha) w, tensor by tensor."""
    return {n: alpha * v[n] + (1 - alpha) * w[n] for n in w}


def apfl_step(
    task: Task,
    model: TunedModel,
    w: dict[str, torch.nn.Parameter],
    v: dict[str, torch.Tensor],
    alpha: float,
    batch: Batch,
    lr: float,
    alpha_lr: float,
) -> tuple[StepResult, float]:
    """One APFL batch: w, v updated in place; returns the mixed model's result and new alpha."""
    own = task.step(model, batch)
    grads_w = torch.autograd.grad(own.loss, list(w.values()))
    weight = torch.tensor(alpha, device=own.loss.device, requires_grad=True)
    leaves = {n: t.detach().requires_grad_() for n, t in v.items()}
    fixed = {n: p.detach() for n, p in w.items()}
    mixed = task.step(WithTensors(model, mix(leaves, fixed, weight)), batch)
    *grads_v, grad_alpha = torch.autograd.grad(mixed.loss, [*leaves.values(), weight])
    sgd_(w.values(), grads_w, lr)
    sgd_(v.values(), grads_v, lr)
    return mixed, min(max(alpha - alpha_lr * grad_alpha.item(), 0.0), 1.0)


class APFLClient(ClientLogic):
    """Global w from the server and back; personal v and alpha in client state."""

    def personal(
        self, runtime: ClientRuntime, model: TunedModel, lookup: dict
    ) -> tuple[dict[str, torch.Tensor], float]:
        """(v, alpha) saved per ``lookup``, else the model's current tensors and apfl-alpha."""
        names = list(model.parameter_groups())
        state = runtime.store.load(**lookup)
        if state is None:
            return model.tensors_named(names), runtime.config.settings_of(APFLSettings).alpha
        alpha = float(state.pop(ALPHA_KEY).item())
        return state, alpha

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """APFL steps on w, v and alpha; keep v and alpha, send w."""
        model = runtime.model()  # at its initial values: v's start when no state is saved
        v, alpha = self.personal(runtime, model, {"before": server_round})
        model.load_tensors(received)
        names = list(model.parameter_groups())
        w = model.parameters_named(names)
        v = {n: v[n].to(p.device, p.dtype) for n, p in w.items()}
        config = runtime.config
        alpha_lr = config.settings_of(APFLSettings).alpha_step(config.lr)
        current = [alpha]

        def step(batch: Batch) -> list[StepResult]:
            result, current[0] = apfl_step(
                runtime.task, model, w, v, current[0], batch, config.lr, alpha_lr
            )
            return [result]

        stats = local_schedule(runtime, model, w.values(), step, server_round)
        alpha_saved = torch.tensor([current[0]], dtype=torch.float64)
        runtime.store.save(server_round, {**v, ALPHA_KEY: alpha_saved})
        return model.tensors_named(names), stats

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Evaluate alpha v + (1 - alpha) w with the received w and the latest v and alpha."""
        model = runtime.model()
        v, alpha = self.personal(runtime, model, {"at_most": server_round})
        model.load_tensors(received)
        w = model.tensors_named(v)
        model.load_tensors(mix(v, w, alpha))
        return runtime.evaluate(model)
