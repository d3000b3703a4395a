"""TAP's server (sec. 3.1, eq. 1): component-wise FedAvg over the owners, then a post-FL phase.

Each client gets and sends only the components its modality-task pairs use
(``strategies.fedavg``: ``TrainableTensors.users``), and each component is averaged over the
clients that sent it, weighted by their data sizes (eq. 1; the TAP client reports its training
set's size). The released code is reported to average by client count; eq. 1 is what the paper
states, so it is what runs. After the last round comes one post-training round for every client:
TAP's distillation (sec. 3.3); its replies carry no tensors and change nothing here.
"""

from __future__ import annotations

from strategies.fedavg import FedAvgStrategy


class TAPStrategy(FedAvgStrategy):
    """Component-wise FedAvg of W~, and one post-FL distillation round."""

    def post_training_rounds(self) -> int:
        """One: every client trains W~ for P iterations, then distils it into X."""
        return 1
