"""Local training only: each client tunes its own adapter and head; nothing is communicated."""

from __future__ import annotations

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, Split

SPECS = (
    MethodSpec(
        "local",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.split:SplitClient",
        summary="each client tunes its own adapter and head; nothing is communicated",
        split=Split(shared=(), local=None),
        capabilities=AVERAGE_ONLY,
    ),
)
