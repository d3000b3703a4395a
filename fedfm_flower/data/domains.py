"""Synthetic visual domains for the offline feature-skew dataset ``digits-domains``.

Each domain is a fixed, deterministic transform of RGB images in ``[0, 1]`` (shape
``[N, 3, H, W]``): geometry (rotations, flips), photometry (inversion, ink and paper colours,
contrast), blur and a fixed noise pattern, plus combinations. A transform depends only on the
image, never on which other images are in the batch, so a sample looks the same whichever
client split or batch it lands in. Client ``p`` sees domain ``DOMAINS[p % len(DOMAINS)]``;
with the ``natural-id`` partitioner the ``domain`` column makes client ``p`` hold exactly the
samples of domain ``p`` (see ``fedfm_flower.data.partition``). There are ten domains, so the
default ten clients each get a different one. The public split is never transformed: the
foundation model only ever sees clean digits.

Imports inside functions keep ``torch`` out of this module's start-up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the first transform: partition checks need none
    import torch

    Transform = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Domain:
    """A named, deterministic image transform on ``[N, 3, H, W]`` tensors in ``[0, 1]``."""

    name: str
    transform: Transform

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """The transformed images, clamped to ``[0, 1]``."""
        return self.transform(images).clamp(0.0, 1.0)


def _rotate(quarter_turns: int) -> Transform:
    return lambda x: x.rot90(quarter_turns, dims=(2, 3))


def _hflip(x: torch.Tensor) -> torch.Tensor:
    return x.flip(dims=(3,))


def _invert(x: torch.Tensor) -> torch.Tensor:
    return 1.0 - x


def _colourize(ink: tuple[float, float, float], paper: tuple[float, float, float]) -> Transform:
    """Gray intensity becomes a blend from ``paper`` (0) to ``ink`` (1) colour."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        gray = x.mean(dim=1, keepdim=True)
        ink_t = x.new_tensor(ink, device="cpu").view(1, 3, 1, 1)
        paper_t = x.new_tensor(paper, device="cpu").view(1, 3, 1, 1)
        return paper_t + gray * (ink_t - paper_t)

    return apply


def _blur(x: torch.Tensor) -> torch.Tensor:
    """Gaussian blur whose width scales with the image (sigma = H / 12, at least 0.8)."""
    import torch
    import torch.nn.functional as F

    sigma = max(0.8, x.shape[-1] / 12.0)
    radius = max(1, int(round(2 * sigma)))
    offsets = torch.arange(-radius, radius + 1, dtype=x.dtype)
    kernel_1d = torch.exp(-(offsets**2) / (2 * sigma**2))
    kernel_1d = kernel_1d / kernel_1d.sum()
    kernel = (kernel_1d[:, None] * kernel_1d[None, :]).expand(3, 1, -1, -1)
    padded = F.pad(x, (radius,) * 4, mode="replicate")
    return F.conv2d(padded, kernel, groups=3)


@functools.lru_cache(maxsize=32)
def _noise_pattern(seed: int, height: int, width: int) -> torch.Tensor:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 3, height, width, generator=generator)


def _noise(seed: int, scale: float) -> Transform:
    """Add one fixed Gaussian pattern (a 'sensor' signature) to every image."""
    return lambda x: x + scale * _noise_pattern(seed, x.shape[-2], x.shape[-1]).to(x.dtype)


def _contrast(low: float, high: float) -> Transform:
    return lambda x: low + (high - low) * x


def _compose(*transforms: Transform) -> Transform:
    def apply(x: torch.Tensor) -> torch.Tensor:
        for transform in transforms:
            x = transform(x)
        return x

    return apply


DOMAINS: tuple[Domain, ...] = (
    Domain("clean", lambda x: x),
    Domain("rot90", _rotate(1)),
    Domain("rot180", _rotate(2)),
    Domain("inverted", _invert),
    Domain("red-ink", _colourize((1.0, 0.15, 0.1), (0.0, 0.0, 0.0))),
    Domain("cyan-on-navy", _colourize((0.2, 0.95, 1.0), (0.05, 0.05, 0.35))),
    Domain("blurred", _blur),
    Domain("noisy", _noise(seed=7, scale=0.25)),
    Domain("mirrored-inverted", _compose(_hflip, _invert)),
    Domain(
        "faded-green-rot270",
        _compose(_rotate(3), _colourize((0.1, 0.8, 0.2), (0.9, 0.9, 0.8)), _contrast(0.2, 0.8)),
    ),
)


def domain_of(partition_id: int) -> Domain:
    """The domain of client ``partition_id`` (they cycle through ``DOMAINS``)."""
    return DOMAINS[partition_id % len(DOMAINS)]
