"""FedDPA's server (Yang et al. 2024): FedAvg of the global LoRA, one weight per client (eq. 2).

The global adapter (group ``adapter.global``) is averaged over the reporting clients with
weight 1/M each, not by data size (sec. 4.1: "based on the client number rather than the
number of data"); the local adapter (``adapter.local``) never reaches the server (the split
of ``fedfm_flower/methods/feddpa.py``). FedDPA-F
adds one post-training round after the last federated round, in which every client
initialises its local adapter from the final global one and fine-tunes it (Algorithm 1);
FedDPA-T trains the local adapter alongside, every round (Algorithm 2). FedProx (B.1) is a
client-side term (``feddpa-prox-mu``); the server step is the same.
"""

from __future__ import annotations

from strategies.fedavg import FedAvgStrategy


class FedDPAStrategy(FedAvgStrategy):
    """FedDPA-T: the global adapter averaged with equal client weights, the local one kept."""

    weighting = "uniform"


class FedDPAFineTuneStrategy(FedDPAStrategy):
    """FedDPA-F: the same federated rounds, then one round of local fine-tuning."""

    def post_training_rounds(self) -> int:
        """One: every client fine-tunes its local adapter from the final global adapter."""
        return 1
