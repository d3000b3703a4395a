"""Seeded client sampling: the same seed, round and salt give the same sample.

A sample is ``fraction`` of the connected clients (at least ``min-train-clients``). With
``sample-per-task`` and known client tasks it is ``fraction`` of each task's connected clients
instead (at least one each; FedDPA's 40-client setting). Training samples use salt 0,
evaluation samples salt 1, so the two are drawn independently.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.tasks.training import round_seed


class ClientSampler:
    """Draws a round's clients from the connected ones, seeded by the run's seed."""

    def __init__(
        self,
        config: ExperimentConfig,
        client_tasks: Mapping[int, str],
        data_key: Callable[[int], int] = lambda client: client,
    ) -> None:
        self.config = config
        self.client_tasks = client_tasks  # partition -> its task, when the task names them
        self.data_key = data_key  # client id -> its partition (NodeDirectory.data_key)

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
                task = self.client_tasks.get(self.data_key(client), "")
                groups.setdefault(task, []).append(client)
            chosen = []
            for task in sorted(groups):
                members = groups[task]
                chosen += rng.sample(members, min(len(members), math.ceil(fraction * len(members))))
            return sorted(chosen)
        count = min(
            len(clients), max(self.config.min_train_clients, math.ceil(fraction * len(clients)))
        )
        return sorted(rng.sample(clients, count))
