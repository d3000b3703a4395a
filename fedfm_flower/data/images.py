"""Pixels to model inputs: RGB float tensors ``[N, 3, H, W]`` normalized to mean 0.5, std 0.5.

Every source first produces images in ``[0, 1]`` (the range the domain transforms work in);
``normalize`` then maps them to ``[-1, 1]``, the range the tiny ViT and timm's ViTs with
``mean = std = 0.5`` expect. Decoded images (PIL) are resized with PIL's bilinear filter,
which antialiases when shrinking; the 8x8 digits are upscaled with
``torch.nn.functional.interpolate`` (bilinear), as resizing in PIL would first quantize them.

Imports inside functions keep ``PIL`` and ``torch`` out of this module's start-up.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # loaded with the first pixels: partition checks read labels only
    import torch

MEAN = 0.5
STD = 0.5


def normalize(images: torch.Tensor) -> torch.Tensor:
    """Map ``[0, 1]`` images to the model range ``[-1, 1]`` (mean 0.5, std 0.5)."""
    return (images - MEAN) / STD


def upscale_gray(images: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinearly resize gray ``[N, h, w]`` images in ``[0, 1]`` to RGB ``[N, 3, size, size]``."""
    import torch.nn.functional as F

    resized = F.interpolate(
        images[:, None].float(), size=(size, size), mode="bilinear", align_corners=False
    )
    return resized.clamp_(0.0, 1.0).expand(-1, 3, -1, -1).contiguous()


def pil_to_tensor(images: Iterable[Any], size: int) -> torch.Tensor:
    """Decoded images (PIL) to an RGB float tensor ``[N, 3, size, size]`` in ``[0, 1]``."""
    import torch
    from PIL import Image

    arrays = [
        np.asarray(image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR))
        for image in images
    ]
    if not arrays:
        return torch.empty(0, 3, size, size)
    stacked = torch.from_numpy(np.stack(arrays))  # [N, H, W, 3] uint8
    return stacked.permute(0, 3, 1, 2).float().div_(255.0).contiguous()
