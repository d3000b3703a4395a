"""Vision backbones: timm ViTs and ResNets and the offline ones, returned as feature extractors.

Every backbone is a timm model built with ``num_classes=0`` so that its forward returns the
pooled feature of size ``num_features`` (a ViT's class token, a ResNet's global average pool);
a ViT's attention projections are named ``qkv`` everywhere, so LoRA target modules mean the
same thing on every ViT. Pretrained weights come from a local file when ``weights-file`` is set
(timm's ``pretrained_cfg_overlay=dict(file=...)``) or, for the offline backbones
(``OFFLINE_BACKBONES``), from the offline foundation model cache; a timm model with
``pretrained=true`` and no file downloads from the Hub (users with internet only).

Imports inside functions keep ``timm`` out of this module's start-up.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.families import FAMILIES


@dataclass(frozen=True)
class OfflineViTSpec:
    """Architecture of an offline foundation ViT (patch size derived from the image size)."""

    embed_dim: int = 64
    depth: int = 4
    num_heads: int = 4
    mlp_ratio: float = 2.0
    conv_stem: bool = False  # a convolutional patch embedding (ConvStemPatchEmbed)
    warmup_epochs: int = 0  # > 0: pretrain with linear warm-up, then cosine decay to 0

    def patch_size(self, image_size: int) -> int:
        """Patch size giving a 4x4 token grid on small images, 16 from 64 pixels up."""
        return max(1, image_size // 4) if image_size < 64 else 16


TINY_VIT = OfflineViTSpec()
# The ViTs the project pretrains itself on a dataset's public split (fedfm_flower.models.
# foundation): tiny-vit for the fast digits setups, small-vit (6 blocks, width 128) for the
# glyph-domains benchmark on CPU, offline-vit-s (ViT-S/16's shape) for the same code on a GPU.
OFFLINE_VITS: dict[str, OfflineViTSpec] = {
    "tiny-vit": TINY_VIT,
    "small-vit": OfflineViTSpec(
        embed_dim=128, depth=6, num_heads=4, mlp_ratio=2.0, conv_stem=True, warmup_epochs=2
    ),
    "offline-vit-s": OfflineViTSpec(
        embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0, conv_stem=True, warmup_epochs=2
    ),
}


@dataclass(frozen=True)
class OfflineResNetSpec:
    """Architecture of an offline foundation ResNet: timm's ``ResNet`` of basic blocks."""

    layers: tuple[int, ...] = (1, 1, 1, 1)  # blocks per stage
    channels: tuple[int, ...] = (8, 16, 32, 64)  # width per stage
    stem_width: int = 8
    warmup_epochs: int = 0  # > 0: pretrain with linear warm-up, then cosine decay to 0


# The ResNets the project pretrains itself, as the offline ViTs: tiny-resnet for the fast digits
# setups, small-resnet beside small-vit (the CNN column of FedPerfix's Table 3 on CPU: about the
# same number of weights, 0.96M against small-vit's 0.85M, as the paper's ResNet50 has about
# ViT-S's).
OFFLINE_RESNETS: dict[str, OfflineResNetSpec] = {
    "tiny-resnet": OfflineResNetSpec(),
    "small-resnet": OfflineResNetSpec(channels=(28, 56, 112, 224), stem_width=28, warmup_epochs=2),
}
OFFLINE_BACKBONES: dict[str, OfflineViTSpec | OfflineResNetSpec] = {
    **OFFLINE_VITS,
    **OFFLINE_RESNETS,
}


def _conv_stem_embed() -> type:
    """timm's ``PatchEmbed`` with its one strided convolution replaced by a small stem.

    Stride-2 3x3 convolutions with GELU (no normalisation, so nothing in the frozen backbone
    keeps running statistics) halve the image until the last convolution finishes the patch
    stride; the token grid and everything after it are the plain ViT's. Pretrained from scratch
    on a few thousand images in minutes of CPU, a plain ViT of this size stayed near chance for
    8 epochs on the glyph-domains public split (17.6%) where the stem reached 79.9%
    (Xiao et al., 2021, "Early convolutions help transformers see better").
    """
    from timm.layers import PatchEmbed

    class ConvStemPatchEmbed(PatchEmbed):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - PatchEmbed's
            super().__init__(*args, **kwargs)
            width, stride = self.proj.out_channels, self.patch_size[0]
            layers: list[nn.Module] = []
            channels, hidden = self.proj.in_channels, max(width // 4, 8)
            while stride > 2:
                layers += [nn.Conv2d(channels, hidden, 3, stride=2, padding=1), nn.GELU()]
                channels, hidden, stride = hidden, min(hidden * 2, width), stride // 2
            layers.append(nn.Conv2d(channels, width, stride, stride=stride))
            self.proj = nn.Sequential(*layers)

    return ConvStemPatchEmbed


def offline_vit(config: ExperimentConfig) -> nn.Module:
    """The configured offline ViT (``OFFLINE_VITS[config.backbone]``), randomly initialised."""
    from timm.models.vision_transformer import VisionTransformer

    spec = OFFLINE_VITS[config.backbone]
    extra = {"embed_layer": _conv_stem_embed()} if spec.conv_stem else {}
    return VisionTransformer(
        img_size=config.image_size,
        patch_size=spec.patch_size(config.image_size),
        in_chans=3,
        num_classes=0,
        embed_dim=spec.embed_dim,
        depth=spec.depth,
        num_heads=spec.num_heads,
        mlp_ratio=spec.mlp_ratio,
        **extra,
    )


def offline_resnet(config: ExperimentConfig) -> nn.Module:
    """The configured offline ResNet (``OFFLINE_RESNETS[config.backbone]``), randomly
    initialised; its BatchNorms keep running statistics (``models.groups``)."""
    from timm.models.resnet import BasicBlock, ResNet

    spec = OFFLINE_RESNETS[config.backbone]
    return ResNet(
        BasicBlock,
        spec.layers,
        num_classes=0,
        channels=spec.channels,
        stem_width=spec.stem_width,
    )


def offline_backbone(config: ExperimentConfig) -> nn.Module:
    """The configured offline backbone (ViT or ResNet), randomly initialised."""
    if config.backbone in OFFLINE_RESNETS:
        return offline_resnet(config)
    return offline_vit(config)


def tiny_vit(config: ExperimentConfig) -> nn.Module:
    """The tiny CPU ViT for ``config.image_size``, randomly initialised."""
    return offline_vit(config.replace(backbone="tiny-vit"))


def _timm_model(name: str, sized: bool) -> Callable[[ExperimentConfig], nn.Module]:
    """A builder of timm's ``name``; ``sized``: the model takes the image size (a ViT's
    position embedding; a ResNet pools any size)."""

    def build(config: ExperimentConfig) -> nn.Module:
        import timm

        kwargs: dict = {"num_classes": 0}
        if sized:
            kwargs["img_size"] = config.image_size
        if config.pretrained and config.weights_file:
            kwargs["pretrained_cfg_overlay"] = {"file": config.weights_file}
        return timm.create_model(name, pretrained=config.pretrained, **kwargs)

    return build


VISION_BACKBONES: dict[str, Callable[[ExperimentConfig], nn.Module]] = {
    **{name: offline_backbone for name in OFFLINE_BACKBONES},
    **{
        name: _timm_model(name, sized=family == "vit")
        for family in ("vit", "resnet")
        for name in FAMILIES[family].backbones
        if name not in OFFLINE_BACKBONES
    },
}


def freeze(module: nn.Module) -> nn.Module:
    """Turn off gradients for every parameter of ``module``; returns it."""
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    return module


def backbone_fingerprint(module: nn.Module) -> str:
    """A hash of every frozen (non-LoRA) tensor: equal fingerprints mean bit-identical weights."""

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
