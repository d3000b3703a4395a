"""Model families, tuners, named parameter groups and the offline foundation models.

Exports resolve on first use, so importing ``fedfm_flower.models.families`` (the light registry
the config reads) does not import torch.
"""

from __future__ import annotations

from fedfm_flower import lazy_getattr

_EXPORTS = {
    "MODEL_CACHE": "fedfm_flower.models.build",
    "build_model": "fedfm_flower.models.build",
    "initial_trainable": "fedfm_flower.models.build",
    "prepare_foundation": "fedfm_flower.models.build",
    "AdaptedClassifier": "fedfm_flower.models.classifier",
    "TunedModel": "fedfm_flower.models.groups",
    "TrainableTensors": "fedfm_flower.models.groups",
    "backbone_fingerprint": "fedfm_flower.models.backbones",
    "pick_device": "fedfm_flower.models.backbones",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
