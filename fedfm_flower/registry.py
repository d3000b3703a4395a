"""The method registry: method name -> its strategy class, its client logic class, its settings.

Entries name their classes by import path so the ClientApp (which starts a fresh process per
message in deployment) imports only its own client module, never server code. Adding a method
means one strategy module, one client module and one entry here; a method with run-config keys of
its own also declares them in a light settings module (``fedfm_flower.settings``) named by
``settings``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MethodSpec:
    """Where a method's server and client halves live, and what it is."""

    strategy: str
    client: str
    summary: str
    settings: str = ""  # its MethodSettings class (keys <prefix>-*); "" when it has no keys
    tuner: str = "lora"  # what it adds to the backbone (fedfm_flower.models.tuners.TUNERS)
    # The whole ViT trains (else only when train-backbone = true). On a backbone of another
    # family, which is adapter-tuned only, such a method with tuner "none" trains the family's
    # LoRA instead; one with a ViT tuner of its own (FedPerfix) needs a ViT.
    trains_backbone: bool = False
    modalities: tuple[str, ...] = ()  # input modalities it serves (); () means every one


METHODS: dict[str, MethodSpec] = {
    "local": MethodSpec(
        "strategies.local:LocalStrategy",
        "client_apps.baselines:LocalClient",
        "each client tunes its own adapter and head; nothing is communicated",
    ),
    "fedavg": MethodSpec(
        "strategies.fedavg:FedAvgStrategy",
        "client_apps.baselines:FedAvgClient",
        "adapter and head averaged over clients (weighted by examples)",
    ),
    "fedrep": MethodSpec(
        "strategies.fedrep:FedRepStrategy",
        "client_apps.baselines:FedRepClient",
        "adapter averaged, head local; head epochs then adapter epochs (Collins et al. 2021)",
    ),
    "pfedseq": MethodSpec(
        "strategies.pfedseq:PFedSeqStrategy",
        "client_apps.updates:PFedSeqClient",
        "FedAvg of LoRA updates + a Mamba sequential learner's per-client calibrations "
        "(Peng et al. 2025)",
        settings="fedfm_flower.learners.pfedseq_settings:PFedSeqSettings",
    ),
    "pfedpg": MethodSpec(
        "strategies.pfedpg:PFedPGStrategy",
        "client_apps.updates:PFedPGClient",
        "server-side prompt generator (cross-attention over a prompt basis) personalizes "
        "visual prompts (Yang et al. 2023)",
        settings="fedfm_flower.learners.pfedpg_settings:PFedPGSettings",
        tuner="vpt",
    ),
    "fedvpt": MethodSpec(
        "strategies.fedvpt:FedVPTStrategy",
        "client_apps.baselines:FedVPTClient",
        "visual prompts (VPT-shallow) averaged over clients, head local",
        tuner="vpt",
    ),
    "fedvpt-deep": MethodSpec(
        "strategies.fedvpt:FedVPTStrategy",
        "client_apps.baselines:FedVPTClient",
        "VPT-deep prompts (one set per block) averaged over clients, head local",
        tuner="vpt-deep",
    ),
    "fedavg-ft": MethodSpec(
        "strategies.fedavg_ft:FedAvgFineTuneStrategy",
        "client_apps.baselines:FedAvgFineTuneClient",
        "FedAvg, then local fine-tuning of a copy before each evaluation",
    ),
    "centralized": MethodSpec(
        "strategies.centralized:CentralizedStrategy",
        "client_apps.baselines:CentralizedClient",
        "one client trains on every client's training data pooled; all evaluate the result "
        "(FedDPA's Centralized reference; simulation only)",
    ),
    "fedperfix": MethodSpec(
        "strategies.partial:PartialStrategy",
        "client_apps.partial:PartialClient",
        "the whole ViT trains; FedAvg of all but the personal parts (default: prefix adapters "
        "in every attention layer + head) (Sun et al. 2023)",
        settings="fedfm_flower.personal:PartialSettings",
        tuner="perfix",
        trains_backbone=True,
    ),
    "fedbabu": MethodSpec(
        "strategies.fedbabu:FedBABUStrategy",
        "client_apps.fedbabu:FedBABUClient",
        "the whole ViT trains with the head frozen at its init; FedAvg of the body, head "
        "fine-tuned before evaluation (Oh et al. 2022; FedPerfix Table 2)",
        tuner="none",
        trains_backbone=True,
        modalities=("image",),  # it needs a classification head
    ),
    "apfl": MethodSpec(
        "strategies.apfl:APFLStrategy",
        "client_apps.apfl:APFLClient",
        "the whole ViT trains; FedAvg of w, personal v and adaptive alpha per client, "
        "evaluates alpha v + (1 - alpha) w (Deng et al. 2020; FedPerfix Table 2)",
        settings="fedfm_flower.apfl_settings:APFLSettings",
        tuner="none",
        trains_backbone=True,
    ),
    "per-fedavg": MethodSpec(
        "strategies.perfedavg:PerFedAvgStrategy",
        "client_apps.perfedavg:PerFedAvgClient",
        "the whole ViT trains; first-order MAML steps, FedAvg of the meta-model, one "
        "adaptation step before evaluation (Fallah et al. 2020; FedPerfix Table 2)",
        settings="fedfm_flower.perfedavg_settings:PerFedAvgSettings",
        tuner="none",
        trains_backbone=True,
    ),
    "per-fedavg-ft": MethodSpec(
        "strategies.perfedavg:PerFedAvgStrategy",
        "client_apps.perfedavg:PerFedAvgFineTuneClient",
        "Per-FedAvg, then local fine-tuning of a copy before each evaluation (TAP's "
        "Per-FedAvg + Post-train)",
        settings="fedfm_flower.perfedavg_settings:PerFedAvgSettings",
        tuner="none",
        trains_backbone=True,
    ),
    "feddpa-t": MethodSpec(
        "strategies.feddpa:FedDPAStrategy",
        "client_apps.feddpa:FedDPAClient",
        "global LoRA federated (equal client weights), local LoRA trained alongside it every "
        "round and kept; adapters mixed per test instance (Yang et al. 2024, Algorithm 2)",
        settings="fedfm_flower.feddpa_settings:FedDPASettings",
        tuner="dual-lora",
        modalities=("text",),
    ),
    "feddpa-f": MethodSpec(
        "strategies.feddpa:FedDPAFineTuneStrategy",
        "client_apps.feddpa:FedDPAFineTuneClient",
        "global LoRA federated (equal client weights), then a local LoRA fine-tuned from it "
        "after the last round; adapters mixed per test instance (Yang et al. 2024, Algorithm 1)",
        settings="fedfm_flower.feddpa_settings:FedDPASettings",
        tuner="dual-lora",
        modalities=("text",),
    ),
    "tap": MethodSpec(
        "strategies.tap:TAPStrategy",
        "client_apps.tap:TAPClient",
        "component-wise FedAvg of each client's modality-task components; a personal copy X "
        "refreshed by margin-based replacement, then distilled from the federated one after FL "
        "(TAP)",
        settings="fedfm_flower.tap_settings:TAPSettings",
        modalities=("multimodal",),
    ),
    "feddat": MethodSpec(
        "strategies.feddat:FedDATStrategy",
        "client_apps.feddat:FedDATClient",
        "shared LoRA averaged component-wise (equal client weights); a Dual-Adapter Teacher "
        "(frozen received global + client-specific LoRA) and mutual KD (Chen et al. 2024)",
        settings="fedfm_flower.feddat_settings:FedDATSettings",
        modalities=("multimodal",),
    ),
    "feddat-ft": MethodSpec(
        "strategies.feddat:FedDATStrategy",
        "client_apps.feddat:FedDATFineTuneClient",
        "FedDAT, then more of its local training (mutual KD) on a copy before each evaluation "
        "(TAP's FedDAT + Post-train)",
        settings="fedfm_flower.feddat_settings:FedDATSettings",
        modalities=("multimodal",),
    ),
}


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def method_spec(method: str) -> MethodSpec:
    """The registry entry of ``method``, or a ValueError naming the allowed methods."""
    if method not in METHODS:
        raise ValueError(f"method '{method}' unknown; allowed: {', '.join(METHODS)}")
    return METHODS[method]


def strategy_class(method: str) -> Any:
    """The Strategy class of ``method`` (imported on demand)."""
    return _load(method_spec(method).strategy)


def client_class(method: str) -> Any:
    """The client logic class of ``method`` (imported on demand)."""
    return _load(method_spec(method).client)


def _adapts_to_family(config: Any) -> bool:
    """Whether the run's method trains the whole ViT with no tuner of its own (FedBABU, APFL,
    Per-FedAvg) on a backbone of another family, where it trains that family's LoRA instead."""
    from fedfm_flower.models.families import family_of

    spec = method_spec(config.method)
    return (
        spec.trains_backbone and spec.tuner == "none" and family_of(config.backbone).name != "vit"
    )


def tuner_of(config: Any) -> str:
    """The tuner of a run: the config's ``tuner`` unless 'auto', else the method's own (LoRA
    for a whole-ViT method without a tuner on a backbone of another family)."""
    if config.tuner != "auto":
        return config.tuner
    return "lora" if _adapts_to_family(config) else method_spec(config.method).tuner


def trains_backbone(config: Any) -> bool:
    """Whether the run trains the backbone's own weights: the config says so, or the method
    trains the whole ViT (FedPerfix needs one; FedBABU, APFL, Per-FedAvg adapt to others)."""
    spec = method_spec(config.method)
    return config.train_backbone or (spec.trains_backbone and not _adapts_to_family(config))


def settings_class(method: str) -> Any:
    """The MethodSettings class of ``method``, or None when it has no keys of its own."""
    path = method_spec(method).settings
    return _load(path) if path else None


def settings_classes() -> tuple[Any, ...]:
    """Every registered MethodSettings class once, in registry order (imported on demand)."""
    paths = dict.fromkeys(spec.settings for spec in METHODS.values() if spec.settings)
    return tuple(_load(path) for path in paths)
