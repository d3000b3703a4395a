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
    "vpt": "fedfm_flower.models.tuners.prompts:vpt_shallow_tuner",
    "vpt-deep": "fedfm_flower.models.tuners.prompts:vpt_deep_tuner",
}


def get_tuner(name: str) -> Tuner:
    """The tuner registered as ``name``."""
    if name not in TUNERS:
        raise ValueError(f"tuner '{name}' unknown; known: {', '.join(TUNERS)}")
    module, _, attr = TUNERS[name].partition(":")
    return getattr(importlib.import_module(module), attr)
