"""The Gaussian mechanism: clip each client's update; noise the average (central DP) or each
client's update before it leaves the client (local DP). The noise comes from ``noise``: fresh
OS entropy per release, never a seed."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedfm_flower.privacy import noise


def update_norm(sent: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of (sent - received) over every tensor of ``sent`` together (float64)."""
    total = 0.0
    for name, tensor in sent.items():
        delta = tensor.detach().to(torch.float64) - received[name].detach().to(torch.float64)
        total += float(delta.pow(2).sum())
    return math.sqrt(total)


def clip_update(
    sent: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor], clipping_norm: float
) -> dict[str, torch.Tensor]:
    """received + (sent - received) * min(1, C / ||sent - received||), in ``sent``'s dtypes.

    The norm is over all of ``sent``'s tensors together (one client's whole shared update);
    every tensor of ``sent`` must have been received.
    """
    deltas = clipped_deltas(sent, received, clipping_norm)
    return {
        name: (received[name].detach().to(torch.float64) + delta).to(sent[name].dtype)
        for name, delta in deltas.items()
    }


def clipped_deltas(
    sent: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor], clipping_norm: float
) -> dict[str, torch.Tensor]:
    """(sent - received) * min(1, C / ||sent - received||) in float64, the norm over all of
    ``sent``'s tensors together: what the server sums, so the bound C is not lost to a round
    trip through ``sent``'s dtype (float32 rounding can put received + delta a few 1e-8
    relative beyond it)."""
    if clipping_norm <= 0:
        raise ValueError(f"clipping norm must be > 0, got {clipping_norm}")
    missing = sorted(set(sent) - set(received))
    if missing:
        raise KeyError(f"cannot clip an update of tensors that were not received: {missing[:3]}")
    norm = update_norm(sent, received)
    scale = min(1.0, clipping_norm / norm) if norm > 0 else 1.0
    return {
        name: (tensor.detach().to(torch.float64) - received[name].detach().to(torch.float64))
        * scale
        for name, tensor in sent.items()
    }


def noise_std(noise_multiplier: float, clipping_norm: float, num_sampled: int) -> float:
    """Standard deviation of the noise on the average of ``num_sampled`` clipped updates:
    sigma * C / m (the sum's sensitivity C, divided by the fixed denominator m)."""
    if num_sampled < 1:
        raise ValueError(f"need at least one sampled client, got {num_sampled}")
    return noise_multiplier * clipping_norm / num_sampled


def add_gaussian_noise(tensors: Mapping[str, torch.Tensor], std: float) -> dict[str, torch.Tensor]:
    """Each tensor plus independent N(0, std^2) noise per coordinate, from a generator keyed by
    fresh OS entropy (``noise.fresh_gaussian``: one release), in the tensors' dtypes."""
    if std < 0 or not math.isfinite(std):
        raise ValueError(f"noise std must be finite and >= 0, got {std}")
    if std == 0:
        return dict(tensors)
    drawn = noise.fresh_gaussian({n: tuple(t.shape) for n, t in tensors.items()}, std)
    return {
        name: (tensors[name].to(torch.float64) + drawn[name]).to(tensors[name].dtype)
        for name in sorted(tensors)
    }


def privatize_locally(
    sent: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    clipping_norm: float,
    noise_multiplier: float,
) -> dict[str, torch.Tensor]:
    """Local DP: base + clip(sent - base) + N(0, (sigma C)^2) per coordinate, fresh noise.

    ``base`` is what the client received for parameters, zeros for a reply that is itself an
    update (pFedSeq's and pFedPG's clients).
    """
    clipped = clip_update(sent, base, clipping_norm)
    return add_gaussian_noise(clipped, noise_multiplier * clipping_norm)
