"""The server half of PeFLL (Scott et al., ICLR 2024) on tensors, without any Flower code.

The server holds the hypernetwork h(.; phi) (``fedfm_flower.learners.hypernetwork``), the
embedding network E(.; psi) (``fedfm_flower.learners.embedding_network``), Adam over both, and
per client the last descriptor v_i it reported and that report's round. Client i's payload
(``payload``) is theta_i = h((v_i - m) / s), psi, the round of v_i and, when there is a v_i, the
Jacobian d theta_i / d v_i; a step (``step``) takes the mean over the reporting clients of the
pFedHN vector-Jacobian product for phi and the mean of the psi gradients over the clients that
sent one, clips their joint norm, takes one Adam step and keeps the new descriptors. The
one-message schedule and every choice: ``fedfm_flower.methods.pefll``. The message's extra
tensors are named by the constants below, which ``client_apps.pefll`` reads.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from fedfm_flower.learners.embedding_network import EmbeddingNetwork
from fedfm_flower.learners.hypernetwork import HyperNetworkServer, clip_and_norm, update_surrogate
from fedfm_flower.learners.state import (
    check_client,
    load_optimizer_tensors,
    optimizer_tensors,
    prefixed,
    unprefixed,
)
from fedfm_flower.methods.pefll import MESSAGE_PREFIX, PeFLLSettings

# Down: psi by parameter name, the round of the descriptor theta was generated from, the
# Jacobian of each generated tensor. Up: the new descriptor, the psi gradient, and whether the
# client could compute that gradient (1) or not (0).
EMBEDDING = f"{MESSAGE_PREFIX}embedding."
DESCRIPTOR_ROUND = f"{MESSAGE_PREFIX}descriptor-round"
JACOBIAN = f"{MESSAGE_PREFIX}jacobian."
DESCRIPTOR = f"{MESSAGE_PREFIX}descriptor"
EMBEDDING_GRAD = f"{MESSAGE_PREFIX}embedding-grad."
HAS_GRADIENT = f"{MESSAGE_PREFIX}has-gradient"


class PeFLLServer(HyperNetworkServer):
    """Hypernetwork, embedding network, Adam and the clients' last descriptors of one run."""

    method = "PeFLL"
    settings: PeFLLSettings

    def __init__(
        self,
        settings: PeFLLSettings,
        initial: dict[str, torch.Tensor],
        num_clients: int,
        classes: int,
        image_channels: int = 3,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.classes, self.image_channels = classes, image_channels
        super().__init__(settings, initial, num_clients, seed, device)
        self.descriptors = torch.zeros(num_clients, self.dim)
        self.descriptor_rounds = torch.zeros(num_clients, dtype=torch.int64)  # 0: none yet
        self.normalization = torch.tensor([0.0, 1.0, 0.0])  # shift m, scale s, whether set
        self.round = 0

    def descriptor_networks(self, dim: int) -> nn.Module:
        """The embedding network E(.; psi) that computes a client's descriptor."""
        self.embedding = EmbeddingNetwork(
            self.image_channels,
            self.classes,
            dim,
            self.settings.kernels,
            self.settings.embed_labels,
        )
        return self.embedding

    def parameters(self) -> list[nn.Parameter]:
        """phi, then psi: Adam's parameters, in its order."""
        return [*self.hypernetwork.parameters(), *self.embedding.parameters()]

    def normalized_descriptor(self, client: int) -> torch.Tensor:
        """(v_i - m) / s of client i's last descriptor; 0 (the mean descriptor) without one."""
        client = check_client(client, self.num_clients, "PeFLL")
        if not self.descriptor_rounds[client]:
            return torch.zeros(self.descriptors.shape[1], device=self.device)
        shift, scale, _ = self.normalization.tolist()
        return ((self.descriptors[client] - shift) / scale).to(self.device)

    def payload(self, client: int) -> dict[str, torch.Tensor]:
        """What client i is sent: theta_i, psi, the round of v_i, and d theta_i / d v_i."""
        descriptor = self.normalized_descriptor(client)
        tensors = self.hypernetwork.generate(descriptor)
        tensors.update(
            {EMBEDDING + n: p.detach().cpu().clone() for n, p in self.embedding.named_parameters()}
        )
        tensors[DESCRIPTOR_ROUND] = self.descriptor_rounds[client : client + 1].clone()
        if self.descriptor_rounds[client]:
            scale = float(self.normalization[1])  # d/dv of (v - m) / s
            jacobian = self.hypernetwork.descriptor_jacobian(descriptor)
            tensors.update({JACOBIAN + n: j / scale for n, j in jacobian.items()})
        return tensors

    def accumulate_gradient(
        self,
        updates: dict[int, dict[str, torch.Tensor]],
        embedding_grads: dict[int, dict[str, torch.Tensor]],
    ) -> float:
        """Zero the grads; phi's: backpropagate the mean of -<theta_i, Delta_i> at the
        descriptors the thetas were generated from; psi's: the mean of the gradients the clients
        sent (over those clients only). Returns the surrogate's mean."""
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for client, update in updates.items():
            generated = self.hypernetwork(self.normalized_descriptor(client))
            total = total + update_surrogate(generated, update)
        mean = total / len(updates)
        mean.backward()
        if embedding_grads:
            for name, param in self.embedding.named_parameters():
                summed = sum(g[name].to(self.device, param.dtype) for g in embedding_grads.values())
                param.grad = summed / len(embedding_grads)
        return float(mean.detach())

    def step(
        self,
        server_round: int,
        updates: dict[int, dict[str, torch.Tensor]],
        descriptors: dict[int, torch.Tensor],
        embedding_grads: dict[int, dict[str, torch.Tensor]],
    ) -> dict[str, float]:
        """One server step of ``server_round``: the reporting clients' updates (name -> Delta_i),
        their new descriptors, and the psi gradients of the clients that could compute one."""
        if not updates:
            raise ValueError("PeFLL step needs at least one client update")
        started = time.perf_counter()
        surrogate = self.accumulate_gradient(updates, embedding_grads)
        norm = clip_and_norm(self.parameters(), self.settings.clip)
        self.optimizer.step()
        self.round += 1
        self.keep_descriptors(server_round, descriptors)
        flat = torch.cat([t.float().reshape(-1) for u in updates.values() for t in u.values()])
        known = self.descriptors[self.descriptor_rounds > 0]
        return {
            "pefll-round": float(self.round),
            "pefll-surrogate": surrogate,
            "pefll-grad-norm": norm,
            "pefll-embedding-gradients": float(len(embedding_grads)),
            "pefll-update-rms": float(flat.pow(2).mean().sqrt()),
            # how far the clients' raw descriptors are apart, in units of the normalization's s
            "pefll-descriptor-spread": float(
                (known - known.mean(0)).pow(2).mean().sqrt() / self.normalization[1]
            ),
            "pefll-server-seconds": time.perf_counter() - started,
        }

    def keep_descriptors(self, server_round: int, descriptors: dict[int, torch.Tensor]) -> None:
        """Store the round's descriptors (finite ones); the first ones fix m and s."""
        fresh = {
            check_client(c, self.num_clients, "PeFLL"): v.detach().float().cpu().reshape(-1)
            for c, v in descriptors.items()
            if bool(torch.isfinite(v).all())
        }
        if not fresh:
            return
        if not self.normalization[2]:
            values = torch.cat(list(fresh.values()))
            shift = float(values.mean())
            scale = float(values.std()) if values.numel() > 1 else 1.0
            if not math.isfinite(scale) or scale <= 0:
                scale = 1.0
            self.normalization = torch.tensor([shift, scale, 1.0])
        for client, descriptor in fresh.items():
            self.descriptors[client] = descriptor
            self.descriptor_rounds[client] = server_round

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Both networks, Adam state, descriptors, their rounds, m and s, the round counter."""
        return {
            "round": torch.tensor(self.round, dtype=torch.int64),
            "descriptors": self.descriptors.clone(),
            "descriptor-rounds": self.descriptor_rounds.clone(),
            "normalization": self.normalization.clone(),
            **prefixed(self.hypernetwork, "hypernetwork"),
            **prefixed(self.embedding, "embedding"),
            **optimizer_tensors(self.optimizer),
        }

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore a state written by ``state_tensors`` (same settings and sizes)."""
        self.hypernetwork.load_state_dict(unprefixed(tensors, "hypernetwork"))
        self.embedding.load_state_dict(unprefixed(tensors, "embedding"))
        load_optimizer_tensors(self.optimizer, tensors)
        self.descriptors = tensors["descriptors"].clone()
        self.descriptor_rounds = tensors["descriptor-rounds"].clone()
        self.normalization = tensors["normalization"].clone()
        self.round = int(tensors["round"])
