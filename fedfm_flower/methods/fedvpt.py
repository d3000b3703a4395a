"""FedVPT and FedVPT-deep (pFedPG's baselines): visual prompts averaged, heads local."""

from __future__ import annotations

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, Split

_PROMPTS_SHARED = Split(shared=None, local=("head",))

SPECS = (
    MethodSpec(
        "fedvpt",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.split:SplitClient",
        summary="visual prompts (VPT-shallow) averaged over clients, head local",
        tuner="vpt",
        split=_PROMPTS_SHARED,
        capabilities=AVERAGE_ONLY,
    ),
    MethodSpec(
        "fedvpt-deep",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.split:SplitClient",
        summary="VPT-deep prompts (one set per block) averaged over clients, head local",
        tuner="vpt-deep",
        split=_PROMPTS_SHARED,
        capabilities=AVERAGE_ONLY,
    ),
)
