"""The tuner registry: tuner name -> the function that adds trainable parts to a frozen backbone.

A tuner returns the (possibly wrapped) backbone, the modules it adds to the model and the
parameter-group patterns of everything it added (``fedfm_flower.models.groups``). Methods name
their tuner in the method registry; the model layer never imports the method registry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from fedfm_flower.config import ExperimentConfig
    from fedfm_flower.models.groups import GroupPattern


@dataclass
class TunedParts:
    """What a tuner made: the backbone to use, modules to register, and their group patterns."""

    backbone: nn.Module
    modules: dict[str, nn.Module] = field(default_factory=dict)
    patterns: tuple[GroupPattern, ...] = ()


Tuner = Callable[["nn.Module", "ExperimentConfig"], TunedParts]

TUNERS: dict[str, str] = {
    "lora": "fedfm_flower.models.tuners.lora:lora_tuner",
    "dual-lora": "fedfm_flower.models.tuners.dual_lora:dual_lora_tuner",
    "vpt": "fedfm_flower.models.tuners.prompts:vpt_shallow_tuner",
    "vpt-deep": "fedfm_flower.models.tuners.prompts:vpt_deep_tuner",
    "perfix": "fedfm_flower.models.tuners.prefix:perfix_tuner",
    "prefix-zero": "fedfm_flower.models.tuners.prefix:prefix_zero_tuner",
    "prefix-random": "fedfm_flower.models.tuners.prefix:prefix_random_tuner",
    "mlp-adapter": "fedfm_flower.models.tuners.mlp_adapter:mlp_adapter_tuner",
    "none": "fedfm_flower.models.tuners:no_tuner",
}


def no_tuner(backbone: nn.Module, config: ExperimentConfig) -> TunedParts:
    """Nothing added: the head alone, or the whole ViT with a trainable backbone."""
    return TunedParts(backbone)


def get_tuner(name: str) -> Tuner:
    """The tuner registered as ``name``."""
    if name not in TUNERS:
        raise ValueError(f"tuner '{name}' unknown; known: {', '.join(TUNERS)}")
    module, _, attr = TUNERS[name].partition(":")
    return getattr(importlib.import_module(module), attr)
