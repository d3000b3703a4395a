"""The Centralized reference's client (FedDPA's Table 1 upper reference).

The client the server picks (``strategies.centralized``) trains the shared groups on every
client's training data pooled; every client evaluates the result on its own test split. A
simulation device: in a deployment no node holds the others' data.
"""

from __future__ import annotations

import torch

from client_apps.base import ClientRuntime
from client_apps.split import SplitClient
from fedfm_flower.models import TunedModel
from fedfm_flower.training import TrainStats


class CentralizedClient(SplitClient):
    """FedAvg's client, trained on the pooled data when the server picks it."""

    def local_training(
        self,
        runtime: ClientRuntime,
        model: TunedModel,
        received: dict[str, torch.Tensor],
        server_round: int,
    ) -> TrainStats:
        """Joint training of every trainable group on the pooled training data."""
        shared, local = self.split(runtime, model)
        return runtime.train(
            model, shared + local, runtime.seed(server_round), data=runtime.pooled_train
        )
