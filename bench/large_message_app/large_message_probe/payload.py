"""The synthetic adapter: LoRA A and B of q and v in each of 32 layers of width 4,096."""

from __future__ import annotations

import resource

import torch

LAYERS = 32
WIDTH = 4096


def adapter(rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A LoRA adapter of a 7B model's shape (float32, values from ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for projection in ("q_proj", "v_proj"):
            prefix = f"model.layers.{layer}.self_attn.{projection}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, WIDTH, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(WIDTH, rank, generator=generator)
    return tensors


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors' values."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
