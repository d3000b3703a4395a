"""The server half of pFedPG (Yang et al., ICCV 2023) on tensors, without any Flower code.

The server holds a client-agnostic prompt basis P_base (K x l), one descriptor d_n per client
and a generator G; client n is sent P_n = G(P_base, d_n) and replies with the change of its
prompts after local training, Delta P_n = P_n_tilde - P_n. Generators (``pfedpg-generator``):

* ``cross-attention`` (the paper, eq. 3): P_n = P_base + Softmax(Q K^T / sqrt(l_k)) V W^O with
  Q = d_n W^Q, K = P_base W^K, V = P_base W^V.
* ``basis`` (ablation "P_base only"): P_n = P_base for every client.
* ``mlp`` (pFedHN-style ablation): P_n = MLP(d_n), 3 layers, hidden ``pfedpg-hidden``.
* ``adain`` (ablation): P_n is P_base re-normalised with client statistics: per channel,
  mean mu + beta(d_n) and std sigma * (1 + gamma(d_n)), where mu and sigma are P_base's over its
  K prompts and gamma, beta are linear maps of d_n.

Training (eqs. 4, 5): one Adam step (lr ``pfedpg-lr``) on the surrogate
-sum_{n reporting} <P_n, Delta P_n> over G, P_base and the reporting clients' descriptors. Its
gradient is -(d P_n / d phi)^T Delta P_n: Delta P_n points downhill on client n's loss, so this
moves each generated P_n towards P_n_tilde (eq. 5 taken literally, phi <- phi - alpha * grad^T
Delta P, would move it away).

Choices the paper leaves open, made here:

* **Descriptor shape** (``pfedpg-query``). With a single query vector, Softmax(QK^T) is one row
  and every prompt is shifted by the same vector. ``per-prompt`` (default) gives each client K
  query tokens d_n in R^{K x l}, so prompt k retrieves from the basis with its own query;
  ``single`` is the paper's literal d_n in R^{1 x l}, the shift broadcast over the K prompts.
* **Initialisation.** P_base starts at the clients' seeded initial prompts (so round 1 sends
  what FedVPT would), W^O and the MLP's and AdaIN's output maps start at zero, so every client
  starts from P_base and personalization grows only as eq. 5 moves it; W^Q, W^K, W^V are
  Xavier-uniform, descriptors N(0, 1); with prompt-sized keys the first attention weights are
  close to uniform.
* **Partial participation.** Descriptors are one parameter per client; a non-reporting client's
  descriptor has no gradient and Adam skips it, so it is unchanged (with momentum, a zero
  gradient would otherwise still move it). G and P_base move from the reporting clients only.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from fedfm_flower.learners.state import (
    check_client,
    load_optimizer_tensors,
    optimizer_tensors,
    prefixed,
    unprefixed,
)
from fedfm_flower.methods.pfedpg import PFedPGSettings


class PromptGenerator(nn.Module):
    """G(P_base, d_n) for every generator kind; ``forward(n)`` is client n's (K, l) prompts."""

    def __init__(self, settings: PFedPGSettings, initial: torch.Tensor, num_clients: int) -> None:
        super().__init__()
        self.settings = settings  # validated: generator in GENERATORS, query in QUERIES
        num_prompts, width = initial.shape
        self.base = nn.Parameter(initial.detach().clone().float())
        kind = settings.generator
        if kind == "mlp":
            shape = (settings.hidden,)
        elif kind == "cross-attention":
            shape = (num_prompts if settings.query == "per-prompt" else 1, width)
        else:
            shape = (width,)
        self.descriptors = nn.ParameterList(
            nn.Parameter(torch.randn(*shape)) for _ in range(num_clients)
        )
        if kind == "cross-attention":
            inner = settings.attention_dim or width
            self.query = nn.Linear(width, inner, bias=False)
            self.key = nn.Linear(width, inner, bias=False)
            self.value = nn.Linear(width, inner, bias=False)
            self.out = nn.Linear(inner, width, bias=False)
            for linear in (self.query, self.key, self.value):
                nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(self.out.weight)
        elif kind == "mlp":
            hidden = settings.hidden
            self.mlp = nn.Sequential(
                nn.Linear(hidden, hidden),
                nn.ReLU(),
                nn.Linear(hidden, hidden),
                nn.ReLU(),
                nn.Linear(hidden, num_prompts * width),
            )
            nn.init.zeros_(self.mlp[-1].weight)
            with torch.no_grad():
                self.mlp[-1].bias.copy_(initial.detach().reshape(-1))
        elif kind == "adain":
            self.gamma = nn.Linear(width, width)
            self.beta = nn.Linear(width, width)
            for linear in (self.gamma, self.beta):
                nn.init.zeros_(linear.weight)
                nn.init.zeros_(linear.bias)

    def forward(self, client: int) -> torch.Tensor:
        """P_client, shape (K, l)."""
        kind = self.settings.generator
        descriptor = self.descriptors[client]
        if kind == "basis":
            return self.base
        if kind == "mlp":
            return self.mlp(descriptor).reshape(self.base.shape)
        if kind == "adain":
            mean = self.base.mean(0, keepdim=True)
            std = self.base.std(0, keepdim=True, unbiased=False) + 1e-6
            normalized = (self.base - mean) / std
            return normalized * std * (1 + self.gamma(descriptor)) + mean + self.beta(descriptor)
        q = self.query(descriptor)  # (K or 1, inner)
        k = self.key(self.base)
        v = self.value(self.base)
        attention = torch.softmax(q @ k.t() / math.sqrt(k.shape[-1]), dim=-1)
        return self.base + self.out(attention @ v)  # (1, l) broadcasts over K for "single"


class PFedPGServer:
    """Generator, basis, descriptors and Adam of one pFedPG run."""

    def __init__(
        self,
        settings: PFedPGSettings,
        initial_prompts: torch.Tensor,
        num_clients: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_clients < 1:
            raise ValueError(f"pFedPG needs at least one client, got {num_clients}")
        self.settings = settings
        self.num_clients = num_clients
        self.device = torch.device(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.generator = PromptGenerator(settings, initial_prompts, num_clients).to(self.device)
        self.optimizer = torch.optim.Adam(self.generator.parameters(), lr=settings.lr)
        self.round = 0

    def prompts_for(self, client: int) -> torch.Tensor:
        """P_client (K, l) as the generator makes it now."""
        with torch.no_grad():
            prompts = self.generator(check_client(client, self.num_clients, "pFedPG")).expand_as(
                self.generator.base
            )
            return prompts.detach().cpu().clone()

    def accumulate_surrogate_gradient(self, updates: dict[int, torch.Tensor]) -> float:
        """Zero the grads, backpropagate -sum_n <P_n, Delta P_n>; returns sum_n <P_n, Delta P_n>."""
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for client, delta in updates.items():
            prompts = self.generator(check_client(client, self.num_clients, "pFedPG")).expand_as(
                self.generator.base
            )
            total = total + (prompts * delta.to(self.device, prompts.dtype)).sum()
        (-total).backward()
        return float(total.detach())

    def step(self, updates: dict[int, torch.Tensor]) -> dict[str, float]:
        """One server step from the reporting clients' prompt changes (K, l) each."""
        if not updates:
            raise ValueError("pFedPG step needs at least one client update")
        started = time.perf_counter()
        surrogate = self.accumulate_surrogate_gradient(updates)
        self.optimizer.step()
        self.round += 1
        deltas = torch.stack([u.float() for u in updates.values()])
        prompts = torch.stack([self.prompts_for(c) for c in range(self.num_clients)])
        return {
            "pfedpg-round": float(self.round),
            "pfedpg-surrogate": surrogate,
            "pfedpg-update-rms": float(deltas.pow(2).mean().sqrt()),
            # how far the clients' prompts are apart: RMS of P_n - mean_n P_n
            "pfedpg-prompt-spread": float((prompts - prompts.mean(0)).pow(2).mean().sqrt()),
            "pfedpg-server-seconds": time.perf_counter() - started,
        }

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Generator (with basis and descriptors), Adam state and round counter."""
        return {
            "round": torch.tensor(self.round, dtype=torch.int64),
            **prefixed(self.generator, "generator"),
            **optimizer_tensors(self.optimizer),
        }

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore a state written by ``state_tensors`` (same settings and sizes)."""
        self.generator.load_state_dict(unprefixed(tensors, "generator"))
        load_optimizer_tensors(self.optimizer, tensors)
        self.round = int(tensors["round"])
