"""The Centralized reference (FedDPA's Table 1): one model trained on all clients' data pooled.

Every round the lowest connected client id, the "center", trains the shared groups on the
pooled training data of every client (``client_apps.centralized``); every
client evaluates the result on its own test split. With R rounds of E local epochs the model
sees R x E epochs of the pooled data, as a centralized run of that many epochs would.
"""

from __future__ import annotations

from strategies.fedavg import FedAvgStrategy


class CentralizedStrategy(FedAvgStrategy):
    """FedAvg's state and messages, trained by one client on the pooled data."""

    def train_clients(self, server_round: int) -> list[int]:
        """The center (the lowest client id) trains; evaluation samples as usual."""
        return self.clients()[:1]
