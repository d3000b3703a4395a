"""Clients of the hypernetwork-style methods: they send the change of what they received.

pFedSeq and pFedPG send Delta = (locally trained) - (received) for the shared group, which the
server uses as a gradient proxy; the head is trained jointly with it and never leaves the client.
"""

from __future__ import annotations

import torch

from client_apps.base import ClientRuntime
from client_apps.baselines import SplitClient
from fedfm_flower.training import TrainStats


class UpdateClient(SplitClient):
    """Shared group from the server, head in client state; replies with the shared update."""

    local: tuple[str, ...] | None = ("head",)

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Joint local epochs on the shared group and the head; return trained - received."""
        trained, stats = super().train(runtime, received, server_round)
        return {k: v - received[k].to(v.dtype) for k, v in trained.items()}, stats


class PFedSeqClient(UpdateClient):
    """pFedSeq: sends the LoRA adapter update Delta_i^t = theta_hat_i^t - theta_i^{t-1}."""

    shared = ("adapter",)


class PFedPGClient(UpdateClient):
    """pFedPG: sends the prompt change Delta P_n = P_n_tilde - P_n."""

    shared = ("prompt",)
