"""pFedSeq as a Flower strategy: per-client adapters from ``fedfm_flower.learners.pfedseq``.

Clients send adapter updates Delta_i^t (never heads); each client is sent its own personalized
adapter theta_i only. The learners need the number of clients N (one channel each) before the
first aggregation: ``num-clients`` when set, otherwise the ``num-partitions`` the nodes report in
the identity query, otherwise the shape of a checkpoint being resumed. Client ids must be
0..N-1 (partition ids in simulation); a node with another id is left out with a clear warning.
"""

from __future__ import annotations

import logging

import torch

from fedfm_flower.config import ExperimentConfig
from fedfm_flower.learners.pfedseq import PFedSeqServer, PFedSeqSettings
from fedfm_flower.models import parameter_group, pick_device
from fedfm_flower.records import tensor_spec
from strategies.base import ClientReply, PersonalizedStrategy

log = logging.getLogger(__name__)


class PFedSeqStrategy(PersonalizedStrategy):
    """FedAvg of adapters plus a sequential learner's per-client calibrations."""

    def __init__(self, config: ExperimentConfig, initial: dict[str, torch.Tensor]) -> None:
        super().__init__(config, initial)
        self.initial_adapter = {
            k: v.clone() for k, v in initial.items() if parameter_group(k) == "adapter"
        }
        if not self.initial_adapter:
            raise ValueError("pFedSeq needs LoRA adapters; check lora-target-modules")
        self.settings = PFedSeqSettings.from_config(config)
        self.server: PFedSeqServer | None = None
        if config.num_clients:
            self.server = self._build(config.num_clients)

    def _build(self, num_clients: int) -> PFedSeqServer:
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
            self.settings.learner.kind,
            server.num_learner_parameters(),
            self.settings.seq_len,
            self.settings.warmup_rounds,
        )
        return server

    def learn_node_mapping(self, grid, server_round: int) -> None:  # noqa: ANN001 - flwr Grid
        """Learn the mapping, size the learners, and leave out ids outside 0..N-1."""
        super().learn_node_mapping(grid, server_round)
        if self.server is None:
            count = self.num_partitions or len(self.node_to_client)
            if count == 0:
                return
            self.server = self._build(count)
        limit = self.server.num_clients
        for node_id, client_id in list(self.node_to_client.items()):
            if not 0 <= client_id < limit:
                log.warning(
                    "node %s has client-id %s outside 0..%d; pFedSeq leaves it out (number the "
                    "clients 0..num-clients-1)",
                    node_id,
                    client_id,
                    limit - 1,
                )
                del self.node_to_client[node_id]

    def _require_server(self) -> PFedSeqServer:
        if self.server is None:
            raise RuntimeError("pFedSeq does not know the number of clients yet; set num-clients")
        return self.server

    def train_payload(self, client_id: int, server_round: int) -> dict[str, torch.Tensor]:
        """theta_i of the last round, for client i only."""
        return self._require_server().adapter_for(client_id)

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """A reply is the adapter update, shaped like the adapter."""
        return tensor_spec(self.initial_adapter)

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> None:
        """One pFedSeq server step (eqs. 1, 5, 6, 3) from the reporting clients' updates."""
        server = self._require_server()
        updates = {r.client_id: server.layout.flatten(r.arrays) for r in replies}
        counts = {r.client_id: r.num_examples for r in replies}
        self.server_metrics = server.step(updates, counts)
        log.info(
            "pfedseq round %d: %s",
            server_round,
            ", ".join(
                f"{k.removeprefix('pfedseq-')} {v:.4g}" for k, v in self.server_metrics.items()
            ),
        )

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The full pFedSeq server state."""
        return self._require_server().state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the server state; the number of clients comes from the checkpoint."""
        num_clients = int(tensors["personal"].shape[0])
        if self.server is None or self.server.num_clients != num_clients:
            self.server = self._build(num_clients)
        self.server.load_state_tensors(tensors)
