"""The tuners' run-config keys, declared beside the tuners (``fedfm_flower.config.keys`` has the
rest).

Plain data like the tuner registry: no torch, so the config reads it in every process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods.settings import setting
from fedfm_flower.models.tuners.registry import TUNERS

TUNER_CHOICES: tuple[str, ...] = ("auto", *TUNERS)
PREFIX_FORMS: tuple[str, ...] = ("parallel", "concat")  # fedfm_flower.models.tuners.prefix


@dataclass(frozen=True)
class TunerKeys:
    """Which tuner adds the trainable parts to the backbone."""

    group: ClassVar[str] = "tuner"
    title: ClassVar[str] = "Tuner"

    tuner: str = setting(
        "auto",
        choices=TUNER_CHOICES,
        doc=(
            "`auto` (the method's own), `lora`, `vpt`, `vpt-deep`, `perfix` (FedPerfix's "
            "adapter-made prefixes), `prefix-zero` / `prefix-random` (vanilla prefixes, zero or "
            "random initialisation), `mlp-adapter` (a bottleneck adapter after every MLP), `none` "
            "(nothing added)"
        ),
    )


@dataclass(frozen=True)
class LoraKeys:
    """The lora and dual-lora tuners (fedfm_flower/models/tuners/lora.py, dual_lora.py)."""

    group: ClassVar[str] = "lora"
    title: ClassVar[str] = "LoRA"

    lora_rank: int = setting(4, positive=True, doc="LoRA rank r")
    lora_alpha: float = setting(
        8.0, positive=True, doc="LoRA scaling alpha (the update is scaled by alpha / r)"
    )
    lora_dropout: float = setting(0.0, within=(0, 1), bounds="[)", doc="dropout on the LoRA path")
    lora_target_modules: str = setting(
        "qkv",
        doc=(
            "comma-separated module names that get LoRA (`qkv`, `proj`, `fc1`, `fc2` in timm "
            "ViTs; `q_proj`, `k_proj`, `v_proj`, `o_proj` in LLaMA models)"
        ),
    )


@dataclass(frozen=True)
class PrefixKeys:
    """The perfix and prefix-* tuners (fedfm_flower/models/tuners/prefix.py)."""

    group: ClassVar[str] = "prefix"
    title: ClassVar[str] = "Prefixes"

    prefix_bottleneck: int = setting(
        256,
        positive=True,
        doc=(
            "width of FedPerfix's prefix adapter (eq. 4); 256 is the authors' ViT-S configuration "
            "(> 0)"
        ),
    )
    prefix_scale: float = setting(
        1.5,
        positive=True,
        doc=(
            "s of eq. 5, multiplying the prefixes; 1.5 is the authors' FedPerfix preset (their "
            "argparse default is 0.8) (> 0)"
        ),
    )
    prefix_form: str = setting(
        "parallel",
        choices=PREFIX_FORMS,
        doc=(
            "`parallel`: the prefixes are added to the keys and values (the authors' code); "
            "`concat`: appended to them along the sequence (the reading under which the paper's "
            "eq. 6 holds)"
        ),
    )


@dataclass(frozen=True)
class MlpAdapterKeys:
    """The mlp-adapter tuner (fedfm_flower/models/tuners/mlp_adapter.py)."""

    group: ClassVar[str] = "mlp-adapter"
    title: ClassVar[str] = "MLP adapters"

    mlp_adapter_bottleneck: int = setting(
        256, positive=True, doc="width of the `mlp-adapter` adapters (> 0)"
    )


@dataclass(frozen=True)
class PromptKeys:
    """The vpt and vpt-deep tuners (fedfm_flower/models/tuners/prompts.py)."""

    group: ClassVar[str] = "vpt"
    title: ClassVar[str] = "Visual prompts"

    vpt_num_prompts: int = setting(
        10,
        positive=True,
        doc=(
            "K, the number of visual prompts inserted after the class token (> 0); per block for "
            "`fedvpt-deep` (VPT-deep). The paper uses 10"
        ),
    )
