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

from fedfm_flower.models.tuners.registry import TUNERS

if TYPE_CHECKING:
    from torch import nn

    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.models.groups import GroupPattern


@dataclass
class TunedParts:
    """What a tuner made: the backbone to use, modules to register, and their group patterns."""

    backbone: nn.Module
    modules: dict[str, nn.Module] = field(default_factory=dict)
    patterns: tuple[GroupPattern, ...] = ()


Tuner = Callable[["nn.Module", "ExperimentConfig"], TunedParts]


def no_tuner(backbone: nn.Module, config: ExperimentConfig) -> TunedParts:
    """Nothing added: the head alone, or the whole ViT with a trainable backbone."""
    return TunedParts(backbone)


def get_tuner(name: str) -> Tuner:
    """The tuner registered as ``name``."""
    if name not in TUNERS:
        raise ValueError(f"tuner '{name}' unknown; known: {', '.join(TUNERS)}")
    module, _, attr = TUNERS[name].partition(":")
    return getattr(importlib.import_module(module), attr)
