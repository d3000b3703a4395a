"""The client of the hypernetwork-style methods (pFedSeq, pFedPG): it sends the change of what it
received.

It sends Delta = (locally trained) - (received) for the method's shared group (pFedSeq's LoRA
adapter, pFedPG's prompts), which the server uses as a gradient proxy; the head is trained
jointly with it and never leaves the client (the methods' split: ``fedfm_flower/methods/``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from client_apps.base import ClientRuntime
from client_apps.split import SplitClient
from fedfm_flower.tasks.training import TrainStats


class UpdateClient(SplitClient):
    """Shared group from the server, head in client state; replies with the shared update."""

    sends_updates: ClassVar[bool] = True

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Joint local epochs on the shared group and the head; return trained - received."""
        trained, stats = super().train(runtime, received, server_round)
        return {k: v - received[k].to(v.dtype) for k, v in trained.items()}, stats
