"""Backbones, the offline foundation model, and adapted classifiers."""

from fedfm_flower.models.adapted import (
    GROUPS,
    MODEL_CACHE,
    AdaptedClassifier,
    build_model,
    initial_trainable,
    parameter_group,
)
from fedfm_flower.models.backbones import backbone_fingerprint, build_backbone, pick_device

__all__ = [
    "GROUPS",
    "MODEL_CACHE",
    "AdaptedClassifier",
    "backbone_fingerprint",
    "build_backbone",
    "build_model",
    "initial_trainable",
    "parameter_group",
    "pick_device",
]
