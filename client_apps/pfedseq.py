"""pFedSeq's client: trains the received personalized adapter and its local head jointly, and
sends the adapter update Delta_i^t = theta_hat_i^t - theta_i^{t-1} (the head never leaves)."""

from __future__ import annotations

import torch

from client_apps.base import ClientRuntime
from client_apps.baselines import SplitClient
from fedfm_flower.training import TrainStats


class PFedSeqClient(SplitClient):
    """Adapter from the server, head in client state; replies with the adapter update."""

    shared = ("adapter",)
    local = ("head",)

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Joint local epochs on adapter and head; return theta_hat - theta_received."""
        trained, stats = super().train(runtime, received, server_round)
        return {k: v - received[k].to(v.dtype) for k, v in trained.items()}, stats
