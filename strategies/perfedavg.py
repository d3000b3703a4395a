"""Per-FedAvg (Fallah et al. 2020), first-order: FedAvg of the meta-model w.

The server averages the clients' w after their local first-order MAML steps, weighted by
examples; each client adapts a copy with one step before evaluating (``client_apps.perfedavg``).
"""

from strategies.fedavg import FedAvgStrategy


class PerFedAvgStrategy(FedAvgStrategy):
    """FedAvg of every trainable tensor (the meta-model)."""
