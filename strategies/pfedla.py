"""pFedLA as a Flower strategy: per-client layer-wise mixes from ``fedfm_flower.learners.pfedla``.

Clients send the update of what they received (the head too unless ``pfedla-head = "local"``);
each client is sent its own mix theta~_i only. N and client ids: see
``strategies.client_slots``.
"""

from __future__ import annotations

import logging

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.learners.pfedla import PFedLAServer, PFedLASettings, num_clients_in
from fedfm_flower.models import TrainableTensors, pick_device
from fedfm_flower.records.messages import tensor_spec
from strategies.client_slots import ClientSlotStrategy, brief
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.exchange import PLAIN_ROUND, RoundInputs
from strategies.parts.replies import ClientReply

log = logging.getLogger(__name__)


class PFedLAStrategy(ClientSlotStrategy):
    """Every client's latest model, mixed layer-wise per client by its own hypernetwork."""

    def __init__(
        self, config: ExperimentConfig, initial: TrainableTensors, context: RunContext = NO_CONTEXT
    ) -> None:
        if initial.users:
            raise ValueError(
                "pFedLA mixes every client's model: it needs a model whose tensors every client "
                "owns, not components of some clients (TAP's multi-task model)"
            )
        self.initial = initial
        self.settings = config.settings_of(PFedLASettings)
        super().__init__(config, initial, context)

    def shared_initial(self) -> dict[str, torch.Tensor]:
        """The initial values of the tensors clients send (the method's split, model order)."""
        shared, _ = self.method.split_names(self.initial.groups)
        return {n: self.initial.tensors[n] for n in shared}

    def build_server(self, num_clients: int) -> PFedLAServer:
        """Stored models and hypernetworks for ``num_clients`` clients."""
        server = PFedLAServer(
            self.settings,
            self.shared_initial(),
            self.initial.groups,
            num_clients,
            seed=self.config.seed,
            device=pick_device(self.config.device),
        )
        log.info(
            "pFedLA: %d clients, %d layers (%s) over %d tensors, head %s",
            num_clients,
            len(server.layers),
            self.settings.layers,
            len(server.models),
            "kept on the clients" if self.settings.head == "local" else "mixed",
        )
        return server

    def num_clients_in(self, tensors: dict[str, torch.Tensor]) -> int:
        """N = hypernetworks in the checkpoint."""
        return num_clients_in(tensors)

    def train_payload(self, client_id: int, server_round: int) -> dict[str, torch.Tensor]:
        """theta~_i for client i only."""
        return self.require_server().model_for(client_id)

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """A reply is the update of the shared tensors, shaped like them."""
        return tensor_spec(self.shared_initial())

    def aggregate(
        self, server_round: int, replies: list[ClientReply], inputs: RoundInputs = PLAIN_ROUND
    ) -> dict[str, float]:
        """One hypernetwork step per reporting client and their new stored models; the
        step's statistics."""
        server = self.require_server()
        metrics = server.step({r.client_id: r.arrays for r in replies})
        log.info("pfedla round %d: %s", server_round, brief(metrics))
        return metrics
