"""The Centralized reference's client (FedDPA's Table 1 upper reference).

The client the server picks (``strategies.centralized``) trains the shared groups on every
client's training data pooled; every client evaluates the result on its own test split. A
simulation device: in a deployment no node holds the others' data.
"""

from __future__ import annotations

from typing import Any

import torch

from client_apps.base import ClientRuntime
from client_apps.split import SplitClient
from fedfm_flower.models import TunedModel


class CentralizedClient(SplitClient):
    """FedAvg's client, trained on the pooled data when the server picks it."""

    def training_options(
        self,
        runtime: ClientRuntime,
        model: TunedModel,
        shared: list[str],
        received: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        """Every trainable group trains on the pooled training data."""
        return {"data": runtime.pooled_train}

    def data_size(self, runtime: ClientRuntime) -> int:
        """The pooled training set's size: the data this reply was trained on."""
        return len(runtime.pooled_train)
