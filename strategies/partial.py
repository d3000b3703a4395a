"""Partial model personalization by name (FedPerfix, FedBN, FedPer / Vanilla Attention, ...).

The parts listed in ``fedperfix-personal`` stay on the clients; every other trainable tensor
(with a trainable ViT, the ViT's own weights) is averaged with FedAvg, weighted by examples
(FedPerfix's eq. 2). FedPerfix is the default, prefix adapters and head; the paper's
sensitivity study and the baselines it derives are the same strategy with other parts
(``configs/fedperfix/``).
"""

from __future__ import annotations

from fedfm_flower.models import TrainableTensors
from fedfm_flower.models.groups import split_names
from fedfm_flower.personal import PartialSettings
from strategies.fedavg import FedAvgStrategy


class PartialStrategy(FedAvgStrategy):
    """FedAvg of everything but the configured personal parts."""

    def split(self, initial: TrainableTensors) -> tuple[list[str], list[str]]:
        """(shared, personal) names; a personal entry that selects nothing is a ValueError."""
        personal = self.config.settings_of(PartialSettings).personal_parts
        try:
            return split_names(initial.groups, None, personal, strict=True)
        except ValueError as err:
            raise ValueError(f"run config 'fedperfix-personal': {err}") from err
