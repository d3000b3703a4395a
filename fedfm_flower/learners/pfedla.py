"""The server half of pFedLA (Ma et al., CVPR 2022) on tensors, without any Flower code.

The server keeps every client's latest model theta_j (the run's shared trainable tensors) and
one hypernetwork per client. Client i is sent theta~_i, every layer l of it the mix
sum_j alpha_ij^l theta_j^l with alpha_i = HN_i(v_i; phi_i); from its update Delta theta_i the
server takes one Adam step on HN_i through theta~_i (gradient proxy -Delta theta_i) and stores
theta_i <- theta~_i + Delta theta_i. The rule, its choices and their reasons:
``fedfm_flower.methods.pfedla``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from torch import nn

from fedfm_flower.learners.layout import layer_key
from fedfm_flower.learners.state import (
    check_client,
    load_optimizer_tensors,
    optimizer_tensors,
    prefixed,
    unprefixed,
)
from fedfm_flower.methods.pfedla import PFedLASettings

MLP_LAYERS = 3  # Linear + ReLU layers before the last FC (both public implementations)


def layer_of(name: str, group: str, layering: str) -> str:
    """The layer tensor ``name`` (of parameter ``group``) is aggregated with."""
    if layering == "tensor":
        return name
    key = layer_key(name)
    return group if key == "<no-layer>" else key


def layer_groups(
    names: list[str], groups: Mapping[str, str], layering: str
) -> dict[str, list[str]]:
    """Layer -> its tensor names (in ``names`` order), layers in order of their first tensor."""
    layers: dict[str, list[str]] = {}
    for name in names:
        layers.setdefault(layer_of(name, groups[name], layering), []).append(name)
    return layers


class AggregationHypernetwork(nn.Module):
    """One client's HN_i(v_i; phi_i): embedding, MLP and a last FC to (L, N) raw weights."""

    def __init__(self, num_layers: int, num_clients: int, embedding_dim: int, hidden: int) -> None:
        super().__init__()
        self.num_layers, self.num_clients = num_layers, num_clients
        self.embedding = nn.Parameter(torch.randn(embedding_dim))
        widths = [embedding_dim] + [hidden] * MLP_LAYERS
        mlp: list[nn.Module] = []
        for width_in, width_out in zip(widths[:-1], widths[1:], strict=True):
            mlp += [nn.Linear(width_in, width_out), nn.ReLU()]
        self.mlp = nn.Sequential(*mlp)
        self.out = nn.Linear(hidden, num_layers * num_clients)
        nn.init.uniform_(self.out.weight, 0.0, 1.0)
        nn.init.zeros_(self.out.bias)

    def forward(self) -> torch.Tensor:
        """ReLU of the last FC's outputs, shape (L, N): the weights before normalisation."""
        raw = self.out(self.mlp(self.embedding))
        return torch.relu(raw).reshape(self.num_layers, self.num_clients)


def normalize(raw: torch.Tensor, client: int) -> torch.Tensor:
    """Each row of ``raw`` (L, N) divided by its sum; an all-zero row is one-hot on ``client``."""
    sums = raw.sum(dim=1, keepdim=True)
    own = torch.zeros_like(raw[0])
    own[client] = 1.0
    # The clamp keeps the unused branch finite, so no NaN reaches the gradient of a zero row.
    scaled = raw / sums.clamp_min(torch.finfo(raw.dtype).tiny)
    return torch.where(sums > 0, scaled, own)


class PFedLAServer:
    """Stored client models, one hypernetwork per client and their Adam, of one pFedLA run."""

    def __init__(
        self,
        settings: PFedLASettings,
        initial: Mapping[str, torch.Tensor],
        groups: Mapping[str, str],
        num_clients: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_clients < 1:
            raise ValueError(f"pFedLA needs at least one client, got {num_clients}")
        if not initial:
            raise ValueError("pFedLA needs at least one shared trainable tensor")
        self.settings = settings
        self.num_clients = num_clients
        self.device = torch.device(device)
        self.dtypes = {n: t.dtype for n, t in initial.items()}
        self.layers = layer_groups(list(initial), groups, settings.layers)
        self.layer_index = {n: k for k, names in enumerate(self.layers.values()) for n in names}
        # theta_j of every client j, stacked: name -> (N, *shape), float32 on the device.
        self.models = {
            n: t.detach().float().to(self.device).expand(num_clients, *t.shape).clone()
            for n, t in initial.items()
        }
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.hypernetworks = nn.ModuleList(
                AggregationHypernetwork(
                    len(self.layers), num_clients, settings.embedding_dim, settings.hidden
                )
                for _ in range(num_clients)
            ).to(self.device)
        self.optimizer = torch.optim.Adam(self.hypernetworks.parameters(), lr=settings.lr)
        self.round = 0

    def alpha(self, client: int) -> torch.Tensor:
        """alpha_client (L, N), each row non-negative and summing to 1; with autograd."""
        raw = self.hypernetworks[check_client(client, self.num_clients, "pFedLA")]()
        return normalize(raw, client)

    def mix(self, alpha: torch.Tensor, client: int) -> dict[str, torch.Tensor]:
        """theta~_client from its weights ``alpha`` (L, N): every tensor
        sum_j alpha[its layer, j] theta_j."""
        # Written theta_i + sum_j alpha_j (theta_j - theta_i), equal as the weights sum to 1:
        # where the stored models agree (round 1) the gradient is then exactly 0, where the
        # plain sum leaves float rounding that Adam's normalisation turns into full-size steps.
        mixed = {}
        for name, stacked in self.models.items():
            own = stacked[client]
            weights = alpha[self.layer_index[name]]
            mixed[name] = own + torch.tensordot(weights, stacked - own, dims=1)
        return mixed

    def model_for(self, client: int) -> dict[str, torch.Tensor]:
        """theta~_client, the tensors sent to that client (CPU, the initial dtypes)."""
        with torch.no_grad():
            mixed = self.mix(self.alpha(client), client)
        return {n: t.detach().to("cpu", self.dtypes[n]).clone() for n, t in mixed.items()}

    def accumulate_surrogate_gradient(
        self, updates: Mapping[int, Mapping[str, torch.Tensor]]
    ) -> tuple[float, dict[int, dict[str, torch.Tensor]]]:
        """Zero the grads and backpropagate -sum_i <theta~_i, Delta theta_i> into the reporting
        clients' hypernetworks; (sum_i <theta~_i, Delta theta_i>, each theta~_i detached)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        sent: dict[int, dict[str, torch.Tensor]] = {}
        for client, update in updates.items():
            mixed = self.mix(self.alpha(client), client)
            for name, tensor in mixed.items():
                total = total + (tensor * update[name].to(self.device, torch.float32)).sum()
            sent[client] = {n: t.detach() for n, t in mixed.items()}
        (-total).backward()
        return float(total.detach()), sent

    def step(self, updates: Mapping[int, Mapping[str, torch.Tensor]]) -> dict[str, float]:
        """One server step from the reporting clients' updates (name -> tensor each)."""
        if not updates:
            raise ValueError("pFedLA step needs at least one client update")
        started = time.perf_counter()
        for client, update in updates.items():
            check_client(client, self.num_clients, "pFedLA")
            if set(update) != set(self.models):
                missing = sorted(set(self.models) - set(update))[:3]
                raise KeyError(f"client {client}'s update lacks {missing} or has other tensors")
        surrogate, sent = self.accumulate_surrogate_gradient(updates)
        self.optimizer.step()
        with torch.no_grad():
            for client, update in updates.items():
                for name, stacked in self.models.items():
                    delta = update[name].to(self.device, torch.float32)
                    stacked[client] = sent[client][name] + delta
        self.round += 1
        with torch.no_grad():
            self_weights = [float(self.alpha(c)[:, c].mean()) for c in updates]
        squares = sum(float(u.float().pow(2).sum()) for d in updates.values() for u in d.values())
        count = len(updates) * sum(t[0].numel() for t in self.models.values())
        return {
            "pfedla-round": float(self.round),
            "pfedla-surrogate": surrogate,
            "pfedla-update-rms": (squares / count) ** 0.5,
            # mean over the reporting clients and layers of alpha_ii^l: how much of its own model
            # a client gets (1/N for uniform weights, 1 for a purely local model)
            "pfedla-self-weight": sum(self_weights) / len(self_weights),
            "pfedla-server-seconds": time.perf_counter() - started,
        }

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Stored models, hypernetworks, Adam state and round counter."""
        return {
            "round": torch.tensor(self.round, dtype=torch.int64),
            **{f"models.{n}": t.detach().cpu().clone() for n, t in self.models.items()},
            **prefixed(self.hypernetworks, "hypernetworks"),
            **optimizer_tensors(self.optimizer),
        }

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore a state written by ``state_tensors`` (same settings, tensors and N)."""
        models = unprefixed(dict(tensors), "models")
        if set(models) != set(self.models):
            raise ValueError("the checkpoint's pFedLA models are not this run's shared tensors")
        for name, stacked in self.models.items():
            stacked.copy_(models[name].to(self.device))
        self.hypernetworks.load_state_dict(unprefixed(dict(tensors), "hypernetworks"))
        load_optimizer_tensors(self.optimizer, dict(tensors))
        self.round = int(tensors["round"])


def num_clients_in(tensors: Mapping[str, torch.Tensor]) -> int:
    """N of a state written by ``PFedLAServer.state_tensors``: its hypernetworks' embeddings."""
    return sum(1 for k in tensors if k.startswith("hypernetworks.") and k.endswith(".embedding"))
