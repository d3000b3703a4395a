"""Model families, tuners, named parameter groups and the offline foundation models.

Exports resolve on first use, so importing ``fedfm_flower.models.families`` (the light registry
the config reads) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MODEL_CACHE": "fedfm_flower.models.build",
    "build_model": "fedfm_flower.models.build",
    "initial_trainable": "fedfm_flower.models.build",
    "AdaptedClassifier": "fedfm_flower.models.classifier",
    "TunedModel": "fedfm_flower.models.groups",
    "TrainableTensors": "fedfm_flower.models.groups",
    "backbone_fingerprint": "fedfm_flower.models.backbones",
    "pick_device": "fedfm_flower.models.backbones",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fedfm_flower.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
