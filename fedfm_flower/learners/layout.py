"""A flat view of named parameter tensors, with one contiguous range per backbone layer.

Server-side learners work on one vector of D numbers per client; ``ParameterLayout`` maps named
tensors to that vector and back, in a fixed (sorted-name) order, and groups the ranges by the
backbone layer the tensors belong to: the first ``.<index>.`` in a name (``blocks.3.``,
``layers.11.``) names its layer; tensors without one form a group of their own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"\.(\d+)\.")


def layer_key(name: str) -> str:
    """The layer a parameter belongs to: its name up to the first ``.<index>.``."""
    match = _LAYER.search(name)
    return name[: match.end() - 1] if match else "<no-layer>"


@dataclass(frozen=True)
class LayerRange:
    """The contiguous range ``[start, stop)`` of one layer in the flat vector."""

    key: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        """Number of parameters in this layer."""
        return self.stop - self.start


class ParameterLayout:
    """Named tensors <-> one float32 vector, grouped by layer."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("a parameter layout needs at least one tensor")
        by_layer: dict[str, list[str]] = {}
        for name in sorted(tensors):
            by_layer.setdefault(layer_key(name), []).append(name)
        self.names: list[str] = []
        self.shapes: dict[str, torch.Size] = {}
        self.layers: list[LayerRange] = []
        offset = 0
        for key, names in by_layer.items():
            start = offset
            for name in names:
                self.names.append(name)
                self.shapes[name] = tensors[name].shape
                offset += tensors[name].numel()
            self.layers.append(LayerRange(key, start, offset))
        self.size = offset

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 vector of ``tensors`` (exactly this layout's names and shapes)."""
        if set(tensors) != set(self.names):
            missing = sorted(set(self.names) - set(tensors))[:3]
            extra = sorted(set(tensors) - set(self.names))[:3]
            raise KeyError(f"tensors do not match the layout: missing {missing}, extra {extra}")
        return torch.cat([tensors[n].detach().reshape(-1).float().cpu() for n in self.names])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named tensors (copies) from a vector of this layout's size."""
        if flat.shape != (self.size,):
            raise ValueError(f"expected a vector of {self.size} values, got {tuple(flat.shape)}")
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for name in self.names:
            shape = self.shapes[name]
            count = shape.numel()
            out[name] = flat[offset : offset + count].reshape(shape).clone()
            offset += count
        return out
