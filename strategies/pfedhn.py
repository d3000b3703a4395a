"""pFedHN as a Flower strategy: per-client tensors from ``fedfm_flower.learners.pfedhn``.

Client i is sent theta_i = h(v_i; phi) only (the adapter, and the head under
``pfedhn-head = generated``); it replies with the change Delta theta_i of those tensors, never
its local head. N and client ids: see ``strategies.client_slots``.
"""

from __future__ import annotations

import logging

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.learners.pfedhn import PFedHNServer, PFedHNSettings
from fedfm_flower.methods import descriptor_size
from fedfm_flower.methods.pfedhn import generated_split
from fedfm_flower.models import TrainableTensors, pick_device
from fedfm_flower.records.messages import tensor_spec
from strategies.client_slots import ClientSlotStrategy, brief
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.exchange import PLAIN_ROUND, RoundInputs
from strategies.parts.replies import ClientReply

log = logging.getLogger(__name__)


class PFedHNStrategy(ClientSlotStrategy):
    """A hypernetwork over learnable client descriptors, trained with the clients' updates as
    gradient proxies."""

    def __init__(
        self, config: ExperimentConfig, initial: TrainableTensors, context: RunContext = NO_CONTEXT
    ) -> None:
        self.settings = config.settings_of(PFedHNSettings)
        if not initial.select(["adapter"]):
            raise ValueError("pFedHN generates LoRA adapters; check lora-target-modules")
        self.initial_generated = initial.select(generated_split(config).shared or ())
        super().__init__(config, initial, context)

    def build_server(self, num_clients: int) -> PFedHNServer:
        """Hypernetwork and descriptors for ``num_clients`` clients."""
        server = PFedHNServer(
            self.settings,
            self.initial_generated,
            num_clients,
            seed=self.config.seed,
            device=pick_device(self.config.device),
        )
        log.info(
            "pFedHN: %d clients, descriptors of %d, MLP %d x %d, %d generated tensors "
            "(%d values, head %s)",
            num_clients,
            descriptor_size(self.settings.embedding_dim, num_clients),
            self.settings.layers,
            self.settings.hidden,
            len(self.initial_generated),
            sum(t.numel() for t in self.initial_generated.values()),
            self.settings.head,
        )
        return server

    def num_clients_in(self, tensors: dict[str, torch.Tensor]) -> int:
        """N = descriptors in the checkpoint."""
        return sum(1 for k in tensors if k.startswith("descriptors."))

    def train_payload(self, client_id: int, server_round: int) -> dict[str, torch.Tensor]:
        """theta_i = h(v_i; phi), for client i only."""
        return self.require_server().generated_for(client_id)

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """A reply is the change of the generated tensors, shaped like them."""
        return tensor_spec(self.initial_generated)

    def aggregate(
        self, server_round: int, replies: list[ClientReply], inputs: RoundInputs = PLAIN_ROUND
    ) -> dict[str, float]:
        """One hypernetwork step from the reporting clients' updates; its statistics."""
        metrics = self.require_server().step({r.client_id: r.arrays for r in replies})
        log.info("pfedhn round %d: %s", server_round, brief(metrics))
        return metrics
