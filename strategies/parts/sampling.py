"""Seeded client sampling: the same seed, round and salt give the same sample.

A sample is ``fraction`` of the connected clients (at least ``min-train-clients``). With
``sample-per-task`` and known client tasks it is ``fraction`` of each task's connected clients
instead (at least one each; FedDPA's 40-client setting). Training samples use salt 0,
evaluation samples salt 1, so the two are drawn independently.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

from fedfm_flower.config import ExperimentConfig
from fedfm_flower.training import round_seed


class ClientSampler:
    """Draws a round's clients from the connected ones, seeded by the run's seed."""

    def __init__(self, config: ExperimentConfig, client_tasks: Mapping[int, str]) -> None:
        self.config = config
        self.client_tasks = client_tasks  # client id -> its task, when the task names them

    def sample(
        self, clients: list[int], server_round: int, fraction: float, salt: int = 0
    ) -> list[int]:
        """A seeded sample of ``clients`` (sorted ids) for ``server_round``, sorted."""
        if not clients:
            return []
        rng = random.Random(round_seed(self.config.seed, -1, server_round, salt))
        if self.config.sample_per_task and self.client_tasks:
            groups: dict[str, list[int]] = {}
            for client in clients:
                groups.setdefault(self.client_tasks.get(client, ""), []).append(client)
            chosen = []
            for task in sorted(groups):
                members = groups[task]
                chosen += rng.sample(members, min(len(members), math.ceil(fraction * len(members))))
            return sorted(chosen)
        count = min(
            len(clients), max(self.config.min_train_clients, math.ceil(fraction * len(clients)))
        )
        return sorted(rng.sample(clients, count))
