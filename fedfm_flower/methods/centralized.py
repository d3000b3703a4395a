"""The Centralized reference (FedDPA's Table 1): one model trained on all clients' data pooled."""

from __future__ import annotations

from fedfm_flower.methods import MethodSpec, Split

SPECS = (
    MethodSpec(
        "centralized",
        strategy="strategies.centralized:CentralizedStrategy",
        client="client_apps.centralized:CentralizedClient",
        summary="one client trains on every client's training data pooled; all evaluate the "
        "result (FedDPA's Centralized reference; simulation only)",
        split=Split(shared=None, local=()),
    ),
)
