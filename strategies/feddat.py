"""FedDAT's server (Chen et al., AAAI 2024): an unweighted average of the shared adapter.

Clients send only their shared adapter A_s (the components of their modality-task pairs, as in
TAP's component-wise FedAvg); the client-specific adapter A_c and the frozen global copy A_g stay
on the clients (``client_apps.feddat``). Each component is averaged over the clients that sent it
with equal weights: the authors' ``main`` in ``src/train/main.py`` passes ``nums = [1, ...]`` to
``get_average_net``, whatever the clients' data sizes. No post-training phase.
"""

from __future__ import annotations

from strategies.fedavg import FedAvgStrategy


class FedDATStrategy(FedAvgStrategy):
    """Component-wise FedAvg of the shared adapter over its owners, equal client weights."""

    weighting = "uniform"
