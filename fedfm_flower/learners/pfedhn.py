"""The server half of pFedHN (Shamsian et al., ICML 2021) on tensors, without any Flower code.

The server holds one descriptor v_i per client and a ``HyperNetwork`` h(.; phi)
(``fedfm_flower.learners.hypernetwork``); client i is sent theta_i = h(v_i; phi) and replies with
Delta_i = theta_i~ - theta_i. A step averages the reporting clients' gradient proxies
(d theta_i / d(phi, v_i))^T (theta_i - theta_i~) (one backward pass of the mean of
``update_surrogate``), clips their global norm to ``pfedhn-clip`` and takes one Adam step
(``pfedhn-lr``) on phi and the reporting clients' descriptors. The rule and every choice:
``fedfm_flower.methods.pfedhn``.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from fedfm_flower.learners.hypernetwork import HyperNetworkServer, clip_and_norm, update_surrogate
from fedfm_flower.learners.state import (
    check_client,
    load_optimizer_tensors,
    optimizer_tensors,
    prefixed,
    unprefixed,
)
from fedfm_flower.methods.pfedhn import PFedHNSettings


class PFedHNServer(HyperNetworkServer):
    """Descriptors, hypernetwork and Adam of one pFedHN run."""

    method = "pFedHN"
    settings: PFedHNSettings

    def descriptor_networks(self, dim: int) -> nn.Module:
        """The clients' descriptors v_0..v_{N-1}, drawn from N(0, I)."""
        self.descriptors = nn.ParameterList(
            nn.Parameter(torch.randn(dim)) for _ in range(self.num_clients)
        )
        return self.descriptors

    def parameters(self) -> list[nn.Parameter]:
        """phi, then the descriptors v_0..v_{N-1}: Adam's parameters, in its order."""
        return [*self.hypernetwork.parameters(), *self.descriptors]

    def generated_for(self, client: int) -> dict[str, torch.Tensor]:
        """theta_client = h(v_client; phi) as detached CPU tensors."""
        return self.hypernetwork.generate(
            self.descriptors[check_client(client, self.num_clients, "pFedHN")]
        )

    def accumulate_gradient(self, updates: dict[int, dict[str, torch.Tensor]]) -> float:
        """Zero the grads and backpropagate the mean over ``updates``' clients of
        -<theta_i, Delta_i>; returns that mean (no clipping)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for client, update in updates.items():
            generated = self.hypernetwork(
                self.descriptors[check_client(client, self.num_clients, "pFedHN")]
            )
            total = total + update_surrogate(generated, update)
        mean = total / len(updates)
        mean.backward()
        return float(mean.detach())

    def step(self, updates: dict[int, dict[str, torch.Tensor]]) -> dict[str, float]:
        """One server step from the reporting clients' updates (name -> Delta_i each)."""
        if not updates:
            raise ValueError("pFedHN step needs at least one client update")
        started = time.perf_counter()
        surrogate = self.accumulate_gradient(updates)
        norm = clip_and_norm(self.parameters(), self.settings.clip)
        self.optimizer.step()
        self.round += 1
        flat = torch.cat([t.float().reshape(-1) for u in updates.values() for t in u.values()])
        generated = torch.stack(
            [
                torch.cat([t.reshape(-1) for t in self.generated_for(c).values()])
                for c in range(self.num_clients)
            ]
        )
        return {
            "pfedhn-round": float(self.round),
            "pfedhn-surrogate": surrogate,
            "pfedhn-grad-norm": norm,
            "pfedhn-update-rms": float(flat.pow(2).mean().sqrt()),
            # how far the clients' generated tensors are apart: RMS of theta_i - mean_i theta_i
            "pfedhn-spread": float((generated - generated.mean(0)).pow(2).mean().sqrt()),
            "pfedhn-server-seconds": time.perf_counter() - started,
        }

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Hypernetwork, descriptors, Adam state and round counter."""
        return {
            "round": torch.tensor(self.round, dtype=torch.int64),
            **prefixed(self.hypernetwork, "hypernetwork"),
            **prefixed(self.descriptors, "descriptors"),
            **optimizer_tensors(self.optimizer),
        }

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore a state written by ``state_tensors`` (same settings and sizes)."""
        self.hypernetwork.load_state_dict(unprefixed(tensors, "hypernetwork"))
        self.descriptors.load_state_dict(unprefixed(tensors, "descriptors"))
        load_optimizer_tensors(self.optimizer, tensors)
        self.round = int(tensors["round"])
