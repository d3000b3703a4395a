"""LoRA adapters injected by peft into the backbone's target modules, as named adapters.

peft names an adapter's weights ``<module>.lora_A.<adapter>.weight``; the adapter named
``default`` forms the group ``adapter`` and any other adapter ``name`` the group
``adapter.<name>`` (FedDPA's ``adapter.global`` and ``adapter.local``), so asking for
``adapter`` selects all of them. peft zero-initialises ``lora_B``: a fresh adapter is the
identity update.

Imports inside functions keep ``peft`` out of this module's start-up.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.groups import GroupPattern
from fedfm_flower.models.tuners import TunedParts

DEFAULT_ADAPTER = "default"


def adapter_group(adapter: str) -> str:
    """The parameter group of a named LoRA adapter."""
    return "adapter" if adapter == DEFAULT_ADAPTER else f"adapter.{adapter}"


def lora_patterns(adapters: Sequence[str]) -> tuple[GroupPattern, ...]:
    """Group patterns of the named adapters' ``lora_A``/``lora_B`` weights."""
    return tuple(
        GroupPattern(adapter_group(a), rf"\.lora_[AB]\.{re.escape(a)}\.") for a in adapters
    )


def inject_lora(
    backbone: nn.Module, config: ExperimentConfig, adapters: Sequence[str] = (DEFAULT_ADAPTER,)
) -> nn.Module:
    """``backbone`` with one peft LoRA adapter per name in ``lora-target-modules``."""
    from peft import LoraConfig, inject_adapter_in_model

    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules,
    )
    try:
        for adapter in adapters:
            backbone = inject_adapter_in_model(lora, backbone, adapter_name=adapter)
    except ValueError as err:
        raise ValueError(
            f"run config 'lora-target-modules' = {config.lora_target_modules!r} is invalid "
            f"for backbone '{config.backbone}': {err}"
        ) from err
    return backbone


def lora_tuner(backbone: nn.Module, config: ExperimentConfig) -> TunedParts:
    """One LoRA adapter (group ``adapter``) in the target modules."""
    return TunedParts(inject_lora(backbone, config), {}, lora_patterns([DEFAULT_ADAPTER]))
