"""PerAda's client (Xie et al. 2024): Ditto's client with PerAda's proximal weight.

(a) From the received global adapter w^t, FedAvg's client update (bit for bit); the result w_i^t
is sent. (b) The personal adapter v_i (every trainable tensor, adapter and head, kept in client
state) trains for the run's local schedule, on w's batches in w's order, with the run's
optimizer on the loss plus ``perada-lambda``/2 ||v_i - w^t||^2 anchored at the RECEIVED w^t.
v_i is saved and evaluated; the received global adapter is not. The keeping, restoring and
evaluating of v_i are Ditto's (``client_apps.ditto``); the choices are in
``fedfm_flower.methods.perada``.
"""

from __future__ import annotations

import torch

from client_apps.base import ClientRuntime
from client_apps.ditto import DittoClient
from fedfm_flower.methods.perada import PerAdaSettings
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.training import TrainStats, proximal_term


class PerAdaClient(DittoClient):
    """FedAvg's update of the global adapter; a personal adapter pulled to the received one."""

    def personal_training(
        self,
        runtime: ClientRuntime,
        model: TunedModel,
        names: list[str],
        received: dict[str, torch.Tensor],
        server_round: int,
    ) -> TrainStats:
        """Train ``names`` of ``model`` (holding v_i) on the loss plus lambda/2 ||v_i - w^t||^2
        towards ``received``, for the run's local schedule on w's batches."""
        lam = runtime.config.settings_of(PerAdaSettings).lambda_
        penalty = proximal_term(model.parameters_named(names), received, lam)
        return runtime.train(model, names, runtime.seed(server_round), penalty=penalty)
