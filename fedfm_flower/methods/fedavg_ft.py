"""FedAvg with local fine-tuning before each evaluation (the papers' FedLoRA "+ post-train")."""

from __future__ import annotations

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, Split

SPECS = (
    MethodSpec(
        "fedavg-ft",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.fedavg_ft:FedAvgFineTuneClient",
        summary="FedAvg, then local fine-tuning of a copy before each evaluation",
        split=Split(shared=None, local=()),
        capabilities=AVERAGE_ONLY,
    ),
)
