"""The hypernetwork of pFedHN and PeFLL: h(v; phi), an MLP from a client descriptor v to every
generated tensor, and the surrogate its clients' updates train it through.

``HyperNetwork`` is pFedHN's (Shamsian et al. 2021; its authors' ``CNNHyper``, which PeFLL's
authors reuse): a trunk of ``layers`` Linear layers of width ``hidden`` with a ReLU between two
of them and none after the last (pFedSeq's Appendix B: "a 4-layer MLP ... the hidden size is set
to 100"), then one Linear layer per generated tensor, from the trunk's output to the tensor's
entries ("a fully connected layer to generate the adapter's parameters at each backbone
layer"). The trunk starts at PyTorch's default init under the caller's seed (the authors'
code); each output layer starts with zero weights and the tensor's seeded initial values as
bias, so every descriptor first generates the tuner's own initialization (LoRA's B = 0: the
pretrained model) and the clients' tensors part only as the hypernetwork learns. The authors'
target networks train from scratch, where a random start is harmless; a frozen pretrained
backbone with random LoRA products is not the pretrained model any more.

Training from clients' updates: client i trains the generated theta_i = h(v_i) locally to
theta_i~ and sends Delta_i = theta_i~ - theta_i. ``update_surrogate`` is
sum_i <theta_i, theta_i - theta_i~> (a constant Delta_i): its gradient with respect to the
hypernetwork's parameters and the descriptor is (d theta_i / d(phi, v_i))^T (theta_i - theta_i~),
pFedHN's gradient proxy, a vector-Jacobian product that one backward pass computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Protocol

import torch
from torch import nn

from fedfm_flower.methods import descriptor_size


class HyperNetwork(nn.Module):
    """h(v; phi): ``forward(v)`` maps a descriptor of ``descriptor_dim`` entries to one tensor
    per name of ``initial``, shaped like it."""

    def __init__(
        self,
        descriptor_dim: int,
        initial: Mapping[str, torch.Tensor],
        hidden: int = 100,
        layers: int = 4,
    ) -> None:
        super().__init__()
        if descriptor_dim < 1 or hidden < 1 or layers < 1 or not initial:
            raise ValueError(
                "a hypernetwork needs a descriptor, a width, a layer and a tensor to generate"
            )
        self.names = tuple(initial)
        self.shapes = {name: tuple(t.shape) for name, t in initial.items()}
        trunk: list[nn.Module] = [nn.Linear(descriptor_dim, hidden)]
        for _ in range(layers - 1):
            trunk += [nn.ReLU(), nn.Linear(hidden, hidden)]
        self.trunk = nn.Sequential(*trunk)
        self.heads = nn.ModuleList(nn.Linear(hidden, t.numel()) for t in initial.values())
        with torch.no_grad():
            for head, tensor in zip(self.heads, initial.values(), strict=True):
                head.weight.zero_()
                head.bias.copy_(tensor.detach().reshape(-1).float())

    @property
    def descriptor_dim(self) -> int:
        """How many entries a descriptor has."""
        return self.trunk[0].in_features

    def forward(self, descriptor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The generated tensors of ``descriptor`` (shape ``(descriptor_dim,)``), by name."""
        features = self.trunk(descriptor)
        return {
            name: head(features).reshape(self.shapes[name])
            for name, head in zip(self.names, self.heads, strict=True)
        }

    def generate(self, descriptor: torch.Tensor) -> dict[str, torch.Tensor]:
        """``forward`` without a graph, as detached CPU tensors (what a client is sent)."""
        with torch.no_grad():
            return {n: t.detach().cpu().clone() for n, t in self(descriptor).items()}

    def descriptor_jacobian(self, descriptor: torch.Tensor) -> dict[str, torch.Tensor]:
        """d h(v) / d v at ``descriptor``: per generated tensor of shape S, a ``(*S, d)`` tensor
        (forward mode, one pass per descriptor entry); detached CPU tensors."""
        descriptor = descriptor.detach()
        with torch.no_grad():
            columns = [
                torch.func.jvp(self, (descriptor,), (basis,))[1]
                for basis in torch.eye(len(descriptor), device=descriptor.device)
            ]
        return {name: torch.stack([c[name] for c in columns], dim=-1).cpu() for name in self.names}


def update_surrogate(
    generated: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """-<theta, Delta> summed over the tensors of one client: ``generated`` theta (with its
    graph) against the client's update Delta = theta~ - theta (a constant). Its gradient is the
    vector-Jacobian product (d theta / d .)^T (theta - theta~)."""
    total = torch.zeros((), device=next(iter(generated.values())).device)
    for name, theta in generated.items():
        total = total - (theta * update[name].to(theta.device, theta.dtype)).sum()
    return total


def clip_and_norm(parameters: list[nn.Parameter], max_norm: float) -> float:
    """The global L2 norm of ``parameters``' gradients, clipped to ``max_norm`` when > 0 (the
    authors' ``clip_grad_norm_(hnet.parameters(), 50)``); the norm before clipping."""
    with_grad = [p for p in parameters if p.grad is not None]
    if not with_grad:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in with_grad])))


class HyperNetworkSettings(Protocol):
    """The keys a hypernetwork server reads (``pfedhn-*``, ``pefll-*``)."""

    embedding_dim: int
    hidden: int
    layers: int
    lr: float


class HyperNetworkServer:
    """What the servers of pFedHN and PeFLL share: h(.; phi) over descriptors of
    ``descriptor_size``, the networks a method adds beside it (``descriptor_networks``, drawn
    right after phi from the run's seed, without touching the global generator), both on
    ``device``, and Adam over ``parameters()``."""

    method: ClassVar[str]

    def __init__(
        self,
        settings: HyperNetworkSettings,
        initial: dict[str, torch.Tensor],
        num_clients: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_clients < 1:
            raise ValueError(f"{self.method} needs at least one client, got {num_clients}")
        self.settings = settings
        self.num_clients = num_clients
        self.device = torch.device(device)
        self.dim = descriptor_size(settings.embedding_dim, num_clients)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.hypernetwork = HyperNetwork(self.dim, initial, settings.hidden, settings.layers)
            beside = self.descriptor_networks(self.dim)
        self.hypernetwork.to(self.device)
        beside.to(self.device)
        self.optimizer = torch.optim.Adam(self.parameters(), lr=settings.lr)
        self.round = 0

    def descriptor_networks(self, dim: int) -> nn.Module:
        """The method's learnt networks beside phi (descriptors, an embedding network)."""
        raise NotImplementedError

    def parameters(self) -> list[nn.Parameter]:
        """Adam's parameters, in its order."""
        raise NotImplementedError
