"""Ditto's client (Li et al. 2021, Algorithm 1): FedAvg's update of w, then the personal v.

(a) From the received global model w^t, FedAvg's client update (``SplitClient``'s joint
training: same seed, same batches, bit for bit); the result is sent. (b) The personal model
v (every trainable tensor, kept in client state) trains for Ditto's personal schedule with the
run's optimizer on the loss plus ``ditto-lambda``/2 ||v - w^t||^2, anchored at the tensors
RECEIVED this round (``fedfm_flower.tasks.training.proximal_term``), so each SGD step is
v <- v - lr (grad F(v) + lambda (v - w^t)). v is saved; evaluation loads the latest v and
ignores the received global model. A client with no saved v starts from (and evaluates) the
model's seeded initial values, the server's w^0. The choices are in ``fedfm_flower.methods.ditto``.
"""

from __future__ import annotations

import dataclasses

import torch

from client_apps.base import ClientRuntime
from client_apps.split import SplitClient
from fedfm_flower.methods.ditto import DittoSettings
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.training import EvalStats, TrainStats, proximal_term, train


class DittoClient(SplitClient):
    """FedAvg's client for w; a personal v with a proximal pull to w^t, kept and evaluated."""

    def personal(
        self, runtime: ClientRuntime, model: TunedModel, names: list[str], lookup: dict
    ) -> dict[str, torch.Tensor]:
        """v saved per ``lookup``, else ``model``'s tensors (at their initial values: w^0)."""
        saved = runtime.store.load(**lookup)
        return model.tensors_named(names) if saved is None else saved

    def personal_training(
        self,
        runtime: ClientRuntime,
        model: TunedModel,
        names: list[str],
        received: dict[str, torch.Tensor],
        server_round: int,
    ) -> TrainStats:
        """Train ``names`` of ``model`` (holding v) on the loss plus the proximal term towards
        ``received``, for Ditto's personal schedule at its step size."""
        config = runtime.config
        settings = config.settings_of(DittoSettings)
        lr = settings.personal_step(config.lr)
        if lr != config.lr:
            config = dataclasses.replace(config, lr=lr)
        epochs, steps = settings.schedule(config.local_epochs, config.local_steps)
        params = model.parameters_named(names)
        return train(
            runtime.task,
            model,
            runtime.data.train,
            params.values(),
            config,
            seed=runtime.seed(server_round),  # v sees w's batches, in w's order
            epochs=epochs,
            steps=steps,
            device=runtime.device,
            penalty=proximal_term(params, received, settings.lambda_),
        )

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """FedAvg's update of w (sent), then v's proximal update towards ``received`` (kept)."""
        model = runtime.model()  # at its initial values: v's start when none is saved
        names = self.split(runtime, model)[0]  # every trainable tensor this client owns
        v = self.personal(runtime, model, names, {"before": server_round})
        model.load_tensors(received)
        global_stats = self.local_training(runtime, model, received, server_round)
        sent = model.tensors_named(names)
        model.load_tensors(v)
        personal_stats = self.personal_training(runtime, model, names, received, server_round)
        runtime.store.save(server_round, model.tensors_named(names))
        return sent, global_stats.then(personal_stats)

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Evaluate the latest v (the received global model is not used)."""
        model = runtime.model()
        names = self.split(runtime, model)[0]
        model.load_tensors(self.personal(runtime, model, names, {"at_most": server_round}))
        return runtime.evaluate(model)
