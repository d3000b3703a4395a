"""FedAvg + fine-tuning's client (the papers' FedLoRA "+ post-train" baseline).

Trains as FedAvg; before each evaluation a copy is fine-tuned for ``finetune-steps`` steps or
``finetune-epochs`` epochs on the client's train split and evaluated (at the last round: FedAvg,
then local training). Nothing of the fine-tuning is kept or sent. With ``fedavg-ft-prox-mu`` > 0
the federated local training is FedProx's (``client_apps.fedprox``'s proximal term towards the
received tensors); the fine-tuning never takes the term.
"""

from __future__ import annotations

from typing import Any

import torch

from client_apps.base import ClientRuntime
from client_apps.fedprox import proximal_options
from client_apps.split import SplitClient
from fedfm_flower.methods.fedavg_ft import FedAvgFTSettings
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.training import EvalStats


class FedAvgFineTuneClient(SplitClient):
    """FedAvg; evaluation fine-tunes a copy of the global model on local data first."""

    def training_options(
        self,
        runtime: ClientRuntime,
        model: TunedModel,
        shared: list[str],
        received: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        """FedProx's penalty on the shared parameters when ``fedavg-ft-prox-mu`` > 0 (none at
        0: FedAvg's training, unchanged)."""
        mu = runtime.config.settings_of(FedAvgFTSettings).prox_mu
        return proximal_options(model, shared, received, mu) if mu > 0 else {}

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Fine-tune the shared groups (``ClientRuntime.fine_tune``), then evaluate (nothing is
        kept)."""
        model = self.prepare(runtime, received, {"at_most": server_round})
        runtime.fine_tune(model, self.split(runtime, model)[0], server_round)
        return runtime.evaluate(model)
