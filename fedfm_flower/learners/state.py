"""What the server-side learners share: client-index checks and Adam state as flat tensors."""

from __future__ import annotations

import torch


def check_client(client: int, num_clients: int, method: str) -> int:
    """``client`` if it indexes one of ``num_clients`` learner slots, else a clear error."""
    if not 0 <= client < num_clients:
        raise ValueError(
            f"client-id {client} is outside [0, {num_clients}): {method} keeps one slot per "
            "client; number the clients 0..num-clients-1"
        )
    return client


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as ``adam.<index>.<key>`` CPU tensors."""
    tensors: dict[str, torch.Tensor] = {}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            tensors[f"adam.{index}.{key}"] = torch.as_tensor(value).detach().cpu().clone()
    return tensors


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]):
    """Restore state written by ``optimizer_tensors`` (hyperparameters come from the config)."""
    state = optimizer.state_dict()
    state["state"] = {}
    for key, value in tensors.items():
        if key.startswith("adam."):
            _, index, name = key.split(".", 2)
            state["state"].setdefault(int(index), {})[name] = value.clone()
    optimizer.load_state_dict(state)


def prefixed(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """``module``'s state dict as ``<prefix>.<name>`` CPU tensors."""
    return {f"{prefix}.{k}": v.detach().cpu().clone() for k, v in module.state_dict().items()}


def unprefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The ``<prefix>.*`` entries of ``tensors`` with the prefix removed."""
    start = len(prefix) + 1
    return {k[start:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
