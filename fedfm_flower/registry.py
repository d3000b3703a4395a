"""The method registry: method name -> its strategy class and its client logic class.

Entries name their classes by import path so the ClientApp (which starts a fresh process per
message in deployment) imports only its own client module, never server code. Adding a method
means one strategy module, one client module and one entry here.
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
    tuner: str = "lora"  # what clients train on the frozen backbone: lora, vpt, vpt-deep


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
    ),
    "pfedpg": MethodSpec(
        "strategies.pfedpg:PFedPGStrategy",
        "client_apps.updates:PFedPGClient",
        "server-side prompt generator (cross-attention over a prompt basis) personalizes "
        "visual prompts (Yang et al. 2023)",
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
