"""FedAvg with local fine-tuning before evaluation (the papers' FedLoRA "+post-train").

The server half is plain FedAvg; the fine-tuning happens in the client's evaluate handler
(``client_apps.baselines.FedAvgFineTuneClient``) on a copy that is never sent back.
"""

from strategies.fedavg import FedAvgStrategy


class FedAvgFineTuneStrategy(FedAvgStrategy):
    """FedAvg of adapter and head; clients fine-tune before evaluating."""
