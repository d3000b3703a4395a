"""The Centralized reference (FedDPA's Table 1): one model trained on all clients' data pooled.

Every round the lowest connected client id, the "center", trains the shared groups on the
pooled training data of every client (``client_apps.baselines.CentralizedClient``); every
client evaluates the result on its own test split. With R rounds of E local epochs the model
sees R x E epochs of the pooled data, as a centralized run of that many epochs would.
"""

from __future__ import annotations

from strategies.fedavg import FedAvgStrategy


class CentralizedStrategy(FedAvgStrategy):
    """FedAvg's state and messages, trained by one client on the pooled data."""

    def sample(self, server_round: int, fraction: float, salt: int = 0) -> list[int]:
        """Training goes to the center (the lowest client id); evaluation samples as usual."""
        if salt == 0 and self.phase(server_round) == "train":
            return self.clients()[:1]
        return super().sample(server_round, fraction, salt)
