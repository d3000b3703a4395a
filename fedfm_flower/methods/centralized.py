"""The Centralized reference (FedDPA's Table 1): one model trained on all clients' data pooled."""

from __future__ import annotations

from fedfm_flower.methods import Capabilities, MethodSpec, Split

CAPABILITIES = Capabilities(
    central_dp="the centralized reference pools all data in one client; there is nothing to "
    "aggregate",
    local_dp="the centralized reference pools all data in one client; nothing is released",
    secagg="the centralized reference pools all data in one client; there is no sum to hide",
)

SPECS = (
    MethodSpec(
        "centralized",
        strategy="strategies.centralized:CentralizedStrategy",
        client="client_apps.centralized:CentralizedClient",
        summary="one client trains on every client's training data pooled; all evaluate the "
        "result (FedDPA's Centralized reference; simulation only)",
        split=Split(shared=None, local=()),
        capabilities=CAPABILITIES,
    ),
)
