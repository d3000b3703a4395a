"""Base of the strategies whose server keeps one slot per client (pFedSeq, pFedPG, APPLE, pFedHN,
pFedLA, PeFLL).

Their learners need the number of clients N before the first aggregation: ``num-clients`` when
set, otherwise the ``num-partitions`` the nodes report in the identity query, otherwise the
state of a checkpoint being resumed. Client ids must be 0..N-1 (partition ids in simulation); a
node with another id is refused (``refuse_client``) with a warning that says so, once.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.serverapp import Grid

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models import TrainableTensors
from strategies.base import PersonalizedStrategy
from strategies.parts.context import NO_CONTEXT, RunContext


class ClientSlotStrategy(PersonalizedStrategy):
    """A personalized strategy with a lazily sized per-client server (``self.server``)."""

    def __init__(
        self, config: ExperimentConfig, initial: TrainableTensors, context: RunContext = NO_CONTEXT
    ) -> None:
        super().__init__(config, initial, context)
        self.server: Any = None
        if config.num_clients:
            self.server = self.build_server(config.num_clients)

    def build_server(self, num_clients: int) -> Any:
        """The method's server state for ``num_clients`` clients."""
        raise NotImplementedError

    def num_clients_in(self, tensors: dict[str, torch.Tensor]) -> int:
        """N of a checkpoint written by ``state_tensors``."""
        raise NotImplementedError

    def refuse_client(self, client_id: int) -> str | None:
        """Ids outside 0..N-1 have no slot (N from the server, else the nodes' num-partitions)."""
        limit = self.server.num_clients if self.server is not None else self.nodes.num_partitions
        if limit and not 0 <= client_id < limit:
            return (
                f"client-id {client_id} outside 0..{limit - 1}; {type(self).__name__} has one "
                "slot per client (number the clients 0..num-clients-1)"
            )
        return None

    def learn_node_mapping(self, grid: Grid, server_round: int) -> None:
        """Learn the mapping, then size the server if N was unknown until now."""
        super().learn_node_mapping(grid, server_round)
        if self.server is None:
            count = self.nodes.num_partitions or len(self.nodes.clients())
            if count:
                self.server = self.build_server(count)

    def require_server(self) -> Any:
        """The server state, or a clear error when N is still unknown."""
        if self.server is None:
            raise RuntimeError(
                f"{type(self).__name__} does not know the number of clients yet; set num-clients"
            )
        return self.server

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The full server state."""
        return self.require_server().state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the server state; the number of clients comes from the checkpoint."""
        num_clients = self.num_clients_in(tensors)
        if self.server is None or self.server.num_clients != num_clients:
            self.server = self.build_server(num_clients)
        self.server.load_state_tensors(tensors)


def brief(metrics: dict[str, float]) -> str:
    """``name value`` pairs of a server step's statistics, method prefix dropped, for the log."""
    return ", ".join(f"{k.split('-', 1)[1]} {v:.4g}" for k, v in metrics.items())
