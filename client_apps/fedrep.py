"""FedRep's client (Collins et al. 2021): the adapter shared, the head local, trained head-first.

``head-epochs`` epochs on the head with the adapter fixed, then the local schedule on the adapter
with the head fixed.
"""

from __future__ import annotations

import torch

from client_apps.base import ClientRuntime
from client_apps.split import SplitClient
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.training import TrainStats


class FedRepClient(SplitClient):
    """Adapter shared, head local, trained head-first as in FedRep."""

    def local_training(
        self,
        runtime: ClientRuntime,
        model: TunedModel,
        received: dict[str, torch.Tensor],
        server_round: int,
    ) -> TrainStats:
        """Head epochs with the adapter fixed, then adapter epochs with the head fixed."""
        shared, local = self.split(runtime, model)
        head_stats = runtime.train(
            model,
            local,
            runtime.seed(server_round, salt=1),
            epochs=runtime.config.head_epochs,
            steps=0,
        )
        return head_stats.then(runtime.train(model, shared, runtime.seed(server_round)))
