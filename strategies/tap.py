"""TAP's server (sec. 3.1, eq. 1): component-wise FedAvg over the owners, then a post-FL phase.

Each client gets and sends only the components its modality-task pairs use
(``strategies.fedavg``: ``TrainableTensors.users``), and each component is averaged over the
clients that sent it. ``tap-aggregation = data-size`` (default) weighs each by its data size
|D_i| (eq. 1, and the authors' code, whose per-component averages weigh by dataset size);
``uniform`` gives each of a component's K_r owners 1 / K_r (the form App. B's proof uses).
After the last round comes one post-training round for every client: TAP's distillation
(sec. 3.3); its replies carry no tensors and change nothing here.
"""

from __future__ import annotations

from fedfm_flower.methods.tap import TAPSettings
from strategies.fedavg import FedAvgStrategy


class TAPStrategy(FedAvgStrategy):
    """Component-wise FedAvg of W~, and one post-FL distillation round."""

    def client_weighting(self) -> str:
        """``examples`` (|D_i|, eq. 1) or ``uniform`` (1 / K_r), by ``tap-aggregation``."""
        chosen = self.config.settings_of(TAPSettings).aggregation
        return "uniform" if chosen == "uniform" else "examples"

    def post_training_rounds(self) -> int:
        """One: every client trains W~ for P iterations, then distils it into X."""
        return 1
