"""Example-weighted averaging of named tensors (plain torch, no Flower import).

Shared by the FedAvg-style strategies and the bare benchmark loop (``bench/bare_loop.py``).
"""

from __future__ import annotations

import torch


def weighted_average(
    updates: list[dict[str, torch.Tensor]], weights: list[float]
) -> dict[str, torch.Tensor]:
    """Sum_i w_i x_i / Sum_i w_i per tensor name (float64 accumulation, original dtype)."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weighted_average needs a positive total weight")
    out: dict[str, torch.Tensor] = {}
    for name, first in updates[0].items():
        acc = torch.zeros(first.shape, dtype=torch.float64)
        for update, weight in zip(updates, weights, strict=True):
            acc += update[name].to(torch.float64) * (weight / total)
        out[name] = acc.to(first.dtype)
    return out
