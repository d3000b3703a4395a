"""The client half of FedBABU (Oh et al. 2022), as FedPerfix's Table 2 runs it on a whole ViT.

The head stays at its seeded random initialisation during federated training (the same on
every node, so it is never sent nor stored): only the body (every ``vit.*`` part) trains and
goes to the server for FedAvg. Before each evaluation the head of a copy is fine-tuned on the
client's train split with the body fixed, then the copy is evaluated; nothing of the
fine-tuning is kept (the cached model is reset to its initial values by the next message).

FedPerfix's Sec. 4.1 fine-tunes the head "for one step before the evaluation"; we read "step"
as ``finetune-epochs`` epochs (default 1; ``finetune-steps`` > 0 counts batches instead) of the
configured optimizer. (The authors' code, ``clientbabu.py``, takes ``fine_tuning_steps`` = 1
batch and lets the body train too there.)
"""

from __future__ import annotations

import torch

from client_apps.base import ClientRuntime
from client_apps.split import SplitClient
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.training import EvalStats, TrainStats


class FedBABUClient(SplitClient):
    """Body shared and trained; head frozen at its initial value, fine-tuned only to evaluate."""

    # The split (``fedfm_flower/methods/fedbabu.py``) keeps the head: frozen, never sent, never
    # stored (not personal state).

    def prepare(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], personal_round: dict
    ) -> TunedModel:
        """The model with its initial head and the received body (no client state)."""
        model = runtime.model()
        model.load_tensors(received)
        return model

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Train the body with the head frozen; send the body."""
        model = self.prepare(runtime, received, {})
        body, _ = self.split(runtime, model)
        stats = runtime.train(model, body, runtime.seed(server_round))
        return model.tensors_named(body), stats

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Fine-tune the head (the fine-tuning schedule) with the body fixed, then evaluate."""
        model = self.prepare(runtime, received, {})
        _, head = self.split(runtime, model)
        runtime.fine_tune(model, head, server_round)
        return runtime.evaluate(model)
