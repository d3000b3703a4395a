"""A synthetic federation of quadratic losses that drives pFedSeq's server step without a model.

Client i's loss is f_i(theta) = 1/2 ||theta - theta_i*||^2 over an adapter-shaped vector, with
theta_i* = c + g_{group(i)} + v_i: an optimum shared by all, one shared by the client's group,
and the client's own. Local training is ``local_steps`` SGD steps of rate ``local_lr`` with
Gaussian gradient noise, so a client's update is

    Delta_i = (1 - (1 - lr)^K) (theta_i* - theta_i) + noise,

which points downhill on f_i exactly as a real client's adapter update does. The personalized
error of a round is mean_i ||theta_i - theta_i*||^2 / D; FedAvg's is that of the same server
with the learner never used (warm-up longer than the run), i.e. theta_i = theta_g. Scales are
set so that updates are ~1e-3, as on the offline ViT setups. Used by the tests and by
``bench.pfedseq_quadratic`` to compare learner settings in seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fedfm_flower.learners.pfedseq import PFedSeqServer, PFedSeqSettings


@dataclass(frozen=True)
class QuadraticFederation:
    """The clients' optima and local training of a synthetic federation."""

    num_clients: int = 10
    num_layers: int = 2
    layer_size: int = 256
    num_groups: int = 2
    shared_scale: float = 0.02
    group_scale: float = 0.01
    client_scale: float = 0.005
    local_lr: float = 0.01
    local_steps: int = 5
    noise: float = 2e-4
    seed: int = 0

    def initial_adapter(self) -> dict[str, torch.Tensor]:
        """Zero adapter tensors, one per layer, named like a backbone's blocks."""
        return {
            f"blocks.{layer}.adapter.weight": torch.zeros(self.layer_size)
            for layer in range(self.num_layers)
        }

    def optima(self) -> torch.Tensor:
        """theta_i* for every client: (N, D)."""
        g = torch.Generator().manual_seed(self.seed)
        size = self.num_layers * self.layer_size
        shared = torch.randn(size, generator=g) * self.shared_scale
        groups = torch.randn(self.num_groups, size, generator=g) * self.group_scale
        own = torch.randn(self.num_clients, size, generator=g) * self.client_scale
        membership = torch.arange(self.num_clients) % self.num_groups
        return shared[None] + groups[membership] + own

    def local_update(
        self, theta: torch.Tensor, optimum: torch.Tensor, generator: torch.Generator
    ) -> torch.Tensor:
        """Delta after ``local_steps`` noisy SGD steps on 1/2 ||theta - optimum||^2."""
        start = theta.clone()
        for _ in range(self.local_steps):
            grad = theta - optimum + torch.randn(theta.shape, generator=generator) * self.noise
            theta = theta - self.local_lr * grad
        return theta - start


@dataclass
class QuadraticRun:
    """Per-round figures of one run: personalized error and calibration/update RMS ratio."""

    errors: list[float]
    ratios: list[float]


def run_quadratic(
    settings: PFedSeqSettings, federation: QuadraticFederation, rounds: int
) -> QuadraticRun:
    """Run ``rounds`` pFedSeq server steps on the synthetic federation (all clients report)."""
    server = PFedSeqServer(
        settings, federation.initial_adapter(), federation.num_clients, seed=federation.seed
    )
    optima = federation.optima()
    noise = torch.Generator().manual_seed(federation.seed + 1)
    errors, ratios = [], []
    for _ in range(rounds):
        updates = {
            c: federation.local_update(server.personal[c], optima[c], noise)
            for c in range(federation.num_clients)
        }
        stats = server.step(updates, dict.fromkeys(updates, 1))
        errors.append(float((server.personal - optima).pow(2).mean()))
        ratios.append(stats.get("pfedseq-calibration-ratio", 0.0))
    return QuadraticRun(errors, ratios)


def fedavg_settings(settings: PFedSeqSettings, rounds: int) -> PFedSeqSettings:
    """The same server with the learner never used: every client gets theta_g (FedAvg)."""
    return dataclasses.replace(settings, warmup_rounds=rounds + 1)
