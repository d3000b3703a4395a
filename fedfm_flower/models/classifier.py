"""A frozen vision backbone with a parameter-efficient tuner and a classification head.

The tuner is the method's (``fedfm_flower.models.tuners``): ``lora`` injects LoRA adapters
through peft (group ``adapter``); ``vpt`` / ``vpt-deep`` insert visual prompts (group
``prompt``). The linear classifier ``head.weight``/``head.bias`` is the group ``head``.
Everything else is the backbone, frozen (``requires_grad=False``) and never sent anywhere.

All trainable tensors are initialised from ``config.seed`` so the server and every client start
from the same adapter and head, which FedAvg-style aggregation needs.
"""

from __future__ import annotations

import torch
from torch import nn

from fedfm_flower.config import ExperimentConfig
from fedfm_flower.models.backbones import OFFLINE_VITS, VISION_BACKBONES, freeze, offline_vit
from fedfm_flower.models.groups import GroupPattern, TunedModel
from fedfm_flower.models.tuners import get_tuner

HEAD_PATTERNS = (GroupPattern("head", r"^head\."),)


def vision_backbone(config: ExperimentConfig, *, load_weights: bool = True) -> nn.Module:
    """The configured ViT with its pretrained weights (unless ``load_weights`` is False)."""
    if not load_weights:
        config = config.replace(pretrained=False, weights_file="")
    if config.backbone in OFFLINE_VITS:
        backbone = offline_vit(config)
        if config.pretrained:
            from fedfm_flower.models.foundation import load_foundation_weights

            backbone.load_state_dict(load_foundation_weights(config))
        return backbone
    return VISION_BACKBONES[config.backbone](config)


class AdaptedClassifier(TunedModel):
    """Frozen backbone + the method's tuner (LoRA or visual prompts) + linear head."""

    def __init__(
        self, backbone: nn.Module, num_classes: int, config: ExperimentConfig, tuner: str
    ) -> None:
        super().__init__()
        freeze(backbone)
        parts = get_tuner(tuner)(backbone, config)
        self.backbone = parts.backbone
        self.prompts = parts.modules.get("prompts")
        self.head = nn.Linear(backbone.num_features, num_classes)
        self.group_patterns = parts.patterns + HEAD_PATTERNS

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        if self.prompts is not None:
            return self.head(self.prompts.features(self.backbone, images))
        return self.head(self.backbone(images))


def build_classifier(
    config: ExperimentConfig, tuner: str, num_outputs: int, *, load_weights: bool = True
) -> AdaptedClassifier:
    """A fresh AdaptedClassifier with seeded tuner and head initialisation."""
    with torch.random.fork_rng(devices=[]):
        # A backbone without pretrained weights must still be identical on every node.
        torch.manual_seed(config.seed + 2)
        backbone = vision_backbone(config, load_weights=load_weights)
        torch.manual_seed(config.seed)
        model = AdaptedClassifier(backbone, num_outputs, config, tuner)
        torch.manual_seed(config.seed + 1)
        model.head.reset_parameters()
    return model
