"""FedAvg (McMahan et al. 2017) of the trainable parts: adapter and head, weighted by examples."""

from __future__ import annotations

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, Split

SPECS = (
    MethodSpec(
        "fedavg",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.split:SplitClient",
        summary="adapter and head averaged over clients (weighted by examples)",
        split=Split(shared=None, local=()),
        capabilities=AVERAGE_ONLY,
    ),
)
