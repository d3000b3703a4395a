"""pFedSeq as a Flower strategy: per-client adapters from ``fedfm_flower.learners.pfedseq``.

Clients send adapter updates Delta_i^t (never heads); each client is sent its own personalized
adapter theta_i only. N and client ids: see ``strategies.client_slots``.
"""

from __future__ import annotations

import logging

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.learners.pfedseq import PFedSeqServer, PFedSeqSettings
from fedfm_flower.models import TrainableTensors, pick_device
from fedfm_flower.records.messages import tensor_spec
from strategies.client_slots import ClientSlotStrategy, brief
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.exchange import PLAIN_ROUND, RoundInputs
from strategies.parts.replies import ClientReply

log = logging.getLogger(__name__)


class PFedSeqStrategy(ClientSlotStrategy):
    """FedAvg of adapters plus a sequential learner's per-client calibrations."""

    def __init__(
        self, config: ExperimentConfig, initial: TrainableTensors, context: RunContext = NO_CONTEXT
    ) -> None:
        self.initial_adapter = initial.select(["adapter"])
        if not self.initial_adapter:
            raise ValueError("pFedSeq needs LoRA adapters; check lora-target-modules")
        self.settings = config.settings_of(PFedSeqSettings)
        super().__init__(config, initial, context)

    def build_server(self, num_clients: int) -> PFedSeqServer:
        """Learners, history and adapters for ``num_clients`` clients."""
        server = PFedSeqServer(
            self.settings,
            self.initial_adapter,
            num_clients,
            seed=self.config.seed,
            device=pick_device(self.config.device),
        )
        log.info(
            "pFedSeq: %d clients, %d adapter layers (D = %d), %s learner with %d parameters, "
            "L = %d, warm-up %d rounds",
            num_clients,
            len(server.layout.layers),
            server.layout.size,
            self.settings.learner,
            server.num_learner_parameters(),
            self.settings.seq_len,
            self.settings.warmup_rounds,
        )
        return server

    def num_clients_in(self, tensors: dict[str, torch.Tensor]) -> int:
        """N = rows of the checkpoint's personalized adapters."""
        return int(tensors["personal"].shape[0])

    def train_payload(self, client_id: int, server_round: int) -> dict[str, torch.Tensor]:
        """theta_i of the last round, for client i only."""
        return self.require_server().adapter_for(client_id)

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """A reply is the adapter update, shaped like the adapter."""
        return tensor_spec(self.initial_adapter)

    def aggregate(
        self, server_round: int, replies: list[ClientReply], inputs: RoundInputs = PLAIN_ROUND
    ) -> dict[str, float]:
        """One pFedSeq server step (eqs. 1, 5, 6, 3) from the reporting clients' updates; its
        statistics."""
        server = self.require_server()
        updates = {r.client_id: server.layout.flatten(r.arrays) for r in replies}
        counts = {r.client_id: r.num_examples for r in replies}
        metrics = server.step(updates, counts)
        log.info("pfedseq round %d: %s", server_round, brief(metrics))
        return metrics
