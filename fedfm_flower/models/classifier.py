"""A frozen vision backbone with a parameter-efficient tuner and a classification head.

The tuner is the method's (``fedfm_flower.models.tuners``): ``lora`` injects LoRA adapters
through peft (group ``adapter``); ``vpt`` / ``vpt-deep`` insert visual prompts (group
``prompt``); ``perfix`` and ``prefix-*`` add prefixes (``prefix``); ``mlp-adapter``
(``mlp-adapter``); ``none`` adds nothing. The linear classifier ``head.weight``/``head.bias`` is
the group ``head``. Everything else is the backbone, frozen (``requires_grad=False``) and never
sent anywhere, unless the backbone is trainable (``train_backbone``): then the ViT's own weights
form the ``vit.*`` groups of ``fedfm_flower.models.vit_parts``, a ResNet's the ``resnet.*``
groups of ``fedfm_flower.models.resnet_parts`` (a ResNet takes the tuner ``none`` only).

All trainable tensors are initialised from ``config.seed`` so the server and every client start
from the same adapter and head, which FedAvg-style aggregation needs.
"""

from __future__ import annotations

import torch
from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.backbones import (
    OFFLINE_BACKBONES,
    VISION_BACKBONES,
    freeze,
    offline_backbone,
)
from fedfm_flower.models.families import family_of
from fedfm_flower.models.foundation import load_foundation_weights
from fedfm_flower.models.groups import GroupPattern, TunedModel
from fedfm_flower.models.resnet_parts import RESNET_PART_PATTERNS
from fedfm_flower.models.tuners import get_tuner
from fedfm_flower.models.vit_parts import VIT_PART_PATTERNS

HEAD_PATTERNS = (GroupPattern("head", r"^head\."),)
# The groups of a trainable backbone's own weights, by family.
PART_PATTERNS: dict[str, tuple[GroupPattern, ...]] = {
    "vit": VIT_PART_PATTERNS,
    "resnet": RESNET_PART_PATTERNS,
}


def vision_backbone(config: ExperimentConfig, *, load_weights: bool = True) -> nn.Module:
    """The configured backbone with its pretrained weights (unless ``load_weights`` is
    False)."""
    if not load_weights:
        config = config.replace(pretrained=False, weights_file="")
    if config.backbone in OFFLINE_BACKBONES:
        backbone = offline_backbone(config)
        if config.pretrained:
            backbone.load_state_dict(load_foundation_weights(config))
        return backbone
    return VISION_BACKBONES[config.backbone](config)


class AdaptedClassifier(TunedModel):
    """Backbone (frozen unless ``train_backbone``) + the method's tuner + linear head."""

    def __init__(
        self,
        backbone: nn.Module,
        num_classes: int,
        config: ExperimentConfig,
        tuner: str,
        train_backbone: bool = False,
    ) -> None:
        super().__init__()
        freeze(backbone)
        parts = get_tuner(tuner)(backbone, config)
        self.backbone = parts.backbone
        self.prompts = parts.modules.get("prompts")
        self.head = nn.Linear(backbone.num_features, num_classes)
        # Tuner patterns first: a prefix inside ``attn`` is ``prefix``, not ``vit.attn``.
        own = PART_PATTERNS[family_of(config.backbone).name] if train_backbone else ()
        self.group_patterns = parts.patterns + HEAD_PATTERNS + own

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        if self.prompts is not None:
            return self.head(self.prompts.features(self.backbone, images))
        return self.head(self.backbone(images))


def build_classifier(
    config: ExperimentConfig,
    tuner: str,
    num_outputs: int,
    *,
    load_weights: bool = True,
    train_backbone: bool = False,
) -> AdaptedClassifier:
    """A fresh AdaptedClassifier with seeded tuner and head initialisation."""
    with torch.random.fork_rng(devices=[]):
        # A backbone without pretrained weights must still be identical on every node.
        torch.manual_seed(config.seed + 2)
        backbone = vision_backbone(config, load_weights=load_weights)
        torch.manual_seed(config.seed)
        model = AdaptedClassifier(backbone, num_outputs, config, tuner, train_backbone)
        torch.manual_seed(config.seed + 1)
        model.head.reset_parameters()
    return model
