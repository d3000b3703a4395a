"""Vision backbones: timm ViTs and the tiny CPU ViT, returned as feature extractors.

Every backbone is a timm ``VisionTransformer`` built with ``num_classes=0`` so that its forward
returns the pooled class-token feature of size ``num_features``; attention projections are
named ``qkv`` everywhere, so LoRA target modules mean the same thing on every backbone.
Pretrained weights come from a local file when ``weights-file`` is set (timm's
``pretrained_cfg_overlay=dict(file=...)``) or, for the tiny ViT, from the offline foundation
model cache; a timm ViT with ``pretrained=true`` and no file downloads from the Hub (users with
internet only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fedfm_flower.config import ExperimentConfig
from fedfm_flower.models.families import FAMILIES


@dataclass(frozen=True)
class TinyViTSpec:
    """Architecture of the tiny CPU ViT (patch size derived from the image size)."""

    embed_dim: int = 64
    depth: int = 4
    num_heads: int = 4
    mlp_ratio: float = 2.0

    def patch_size(self, image_size: int) -> int:
        """Patch size giving a 4x4 token grid on small images, 16 from 64 pixels up."""
        return max(1, image_size // 4) if image_size < 64 else 16


TINY_VIT = TinyViTSpec()


def tiny_vit(config: ExperimentConfig) -> nn.Module:
    """The tiny CPU ViT for ``config.image_size``, randomly initialised."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=config.image_size,
        patch_size=TINY_VIT.patch_size(config.image_size),
        in_chans=3,
        num_classes=0,
        embed_dim=TINY_VIT.embed_dim,
        depth=TINY_VIT.depth,
        num_heads=TINY_VIT.num_heads,
        mlp_ratio=TINY_VIT.mlp_ratio,
    )


def _timm_vit(name: str) -> Callable[[ExperimentConfig], nn.Module]:
    def build(config: ExperimentConfig) -> nn.Module:
        import timm

        kwargs: dict = {"num_classes": 0, "img_size": config.image_size}
        if config.pretrained and config.weights_file:
            kwargs["pretrained_cfg_overlay"] = {"file": config.weights_file}
        return timm.create_model(name, pretrained=config.pretrained, **kwargs)

    return build


VISION_BACKBONES: dict[str, Callable[[ExperimentConfig], nn.Module]] = {
    "tiny-vit": tiny_vit,
    **{name: _timm_vit(name) for name in FAMILIES["vit"].backbones if name != "tiny-vit"},
}


def freeze(module: nn.Module) -> nn.Module:
    """Turn off gradients for every parameter of ``module``; returns it."""
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    return module


def backbone_fingerprint(module: nn.Module) -> str:
    """A hash of every frozen (non-LoRA) tensor: equal fingerprints mean bit-identical weights."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if "lora_" in name:
            continue
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def pick_device(preference: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU; 'cuda' without CUDA is an error."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError("run config 'device' = 'cuda' is invalid: CUDA is not available")
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(preference)
