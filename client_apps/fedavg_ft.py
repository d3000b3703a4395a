"""FedAvg + fine-tuning's client (the papers' FedLoRA "+ post-train" baseline).

Trains as FedAvg; before each evaluation a copy is fine-tuned for ``finetune-steps`` steps or
``finetune-epochs`` epochs on the client's train split and evaluated (at the last round: FedAvg,
then local training). Nothing of the fine-tuning is kept or sent.
"""

from __future__ import annotations

import torch

from client_apps.base import ClientRuntime
from client_apps.split import SplitClient
from fedfm_flower.tasks.training import EvalStats


class FedAvgFineTuneClient(SplitClient):
    """FedAvg; evaluation fine-tunes a copy of the global model on local data first."""

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Fine-tune the shared groups (``ClientRuntime.fine_tune``), then evaluate (nothing is
        kept)."""
        model = self.prepare(runtime, received, {"at_most": server_round})
        runtime.fine_tune(model, self.split(runtime, model)[0], server_round)
        return runtime.evaluate(model)
