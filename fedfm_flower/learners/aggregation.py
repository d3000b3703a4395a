"""Weighted averaging of named tensors over the clients that sent them (plain torch, no Flower).

``average_over_owners`` averages each tensor over its *owners*, the updates that contain it,
with the weights renormalised among them: a component only some clients hold (TAP's modality
encoders, task decoders and experts) is averaged over those clients and nobody else. When every
update has every tensor it is FedAvg's weighted mean. Weights are the method's: example counts
(FedAvg) or equal weights (FedDPA's eq. 2, 1/M). Shared by the FedAvg-style strategies and the
bare benchmark loop (``bench/bare_loop.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

WEIGHTINGS: tuple[str, ...] = ("examples", "uniform")


def client_weights(num_examples: Sequence[int], weighting: str) -> list[float]:
    """Aggregation weights: example counts (all-zero counts fall back to equal) or equal."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting '{weighting}' unknown; allowed: {', '.join(WEIGHTINGS)}")
    if weighting == "uniform" or sum(num_examples) == 0:
        return [1.0] * len(num_examples)
    return [float(n) for n in num_examples]


def average_over_owners(
    updates: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """Per tensor name: Sum_i w_i x_i / Sum_i w_i over the updates i holding that name.

    Accumulates in float64 and returns the first owner's dtype, so the result does not depend
    on the order of the updates. A name whose owners all weigh 0 (they report no examples,
    while other clients do: TAP's components) is averaged with equal weights among them, as
    ``client_weights`` does for a round whose counts are all 0; a negative sum is an error.
    """
    if len(updates) != len(weights):
        raise ValueError(f"{len(updates)} updates but {len(weights)} weights")
    owners: dict[str, list[int]] = {}
    for index, update in enumerate(updates):
        for name in update:
            owners.setdefault(name, []).append(index)
    out: dict[str, torch.Tensor] = {}
    for name, holders in owners.items():
        total = float(sum(weights[i] for i in holders))
        if total < 0 or (total == 0 and any(weights[i] != 0 for i in holders)):
            raise ValueError(f"tensor '{name}': its owners' weights sum to {total}, not > 0")
        held = {i: (weights[i] if total > 0 else 1.0) for i in holders}
        total = float(sum(held.values()))
        first = updates[holders[0]][name]
        acc = torch.zeros(first.shape, dtype=torch.float64)
        for i in holders:
            tensor = updates[i][name]
            if tensor.shape != first.shape:
                raise ValueError(
                    f"tensor '{name}' has shape {tuple(tensor.shape)} in update {i}, "
                    f"{tuple(first.shape)} in update {holders[0]}"
                )
            acc += tensor.to(torch.float64) * (held[i] / total)
        out[name] = acc.to(first.dtype)
    return out


def weighted_average(
    updates: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """Sum_i w_i x_i / Sum_i w_i per tensor name; every update must hold the same names."""
    if not updates:
        raise ValueError("weighted_average needs at least one update")
    names = set(updates[0])
    for index, update in enumerate(updates[1:], start=1):
        if set(update) != names:
            raise ValueError(
                f"update {index} holds different tensors than update 0 "
                f"({sorted(set(update) ^ names)[:3]}); use average_over_owners"
            )
    if float(sum(weights)) <= 0:
        raise ValueError("weighted_average needs a positive total weight")
    return average_over_owners(updates, weights)
