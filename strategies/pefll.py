"""PeFLL as a Flower strategy: one message per client and round, from
``fedfm_flower.learners.pefll``.

Client i is sent its own theta_i (generated from its last descriptor), the embedding network and
the hypernetwork's Jacobian at that descriptor; it replies with the change of theta_i, its new
descriptor and its embedding-network gradient (``fedfm_flower.methods.pefll`` says why one
message and what that changes). N and client ids: see ``strategies.client_slots``.
"""

from __future__ import annotations

import logging

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.learners import pefll as L
from fedfm_flower.methods import descriptor_size
from fedfm_flower.methods.pefll import (
    IMAGE_CHANNELS,
    PeFLLSettings,
    generated_split,
)
from fedfm_flower.models import TrainableTensors, pick_device
from fedfm_flower.records.messages import tensor_spec
from strategies.client_slots import ClientSlotStrategy, brief
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.exchange import PLAIN_ROUND, RoundInputs
from strategies.parts.replies import ClientReply

log = logging.getLogger(__name__)


def head_classes(initial: TrainableTensors) -> int:
    """The number of classes: the length of the head's bias."""
    biases = [t for t in initial.select(["head"]).values() if t.ndim == 1]
    if not biases:
        raise ValueError("PeFLL embeds labels and needs a classification head")
    return int(biases[-1].shape[0])


class PeFLLStrategy(ClientSlotStrategy):
    """An embedding network and a hypernetwork, trained from the clients' updates, descriptors
    and embedding-network gradients."""

    def __init__(
        self, config: ExperimentConfig, initial: TrainableTensors, context: RunContext = NO_CONTEXT
    ) -> None:
        self.settings = config.settings_of(PeFLLSettings)
        if not initial.select(["adapter"]):
            raise ValueError("PeFLL generates LoRA adapters; check lora-target-modules")
        self.initial_generated = initial.select(generated_split(config).shared or ())
        self.classes = head_classes(initial)
        super().__init__(config, initial, context)

    def build_server(self, num_clients: int) -> L.PeFLLServer:
        """Both networks and the descriptor slots for ``num_clients`` clients."""
        server = L.PeFLLServer(
            self.settings,
            self.initial_generated,
            num_clients,
            self.classes,
            IMAGE_CHANNELS,
            seed=self.config.seed,
            device=pick_device(self.config.device),
        )
        log.info(
            "PeFLL: %d clients, descriptors of %d, %d generated tensors (%d values, head %s), "
            "embedding network of %d parameters",
            num_clients,
            descriptor_size(self.settings.embedding_dim, num_clients),
            len(self.initial_generated),
            sum(t.numel() for t in self.initial_generated.values()),
            self.settings.head,
            sum(p.numel() for p in server.embedding.parameters()),
        )
        return server

    def num_clients_in(self, tensors: dict[str, torch.Tensor]) -> int:
        """N = rows of the checkpoint's descriptors."""
        return int(tensors["descriptors"].shape[0])

    def train_payload(self, client_id: int, server_round: int) -> dict[str, torch.Tensor]:
        """theta_i, psi, the round of v_i and d theta_i / d v_i, for client i only."""
        return self.require_server().payload(client_id)

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """The change of theta_i, the descriptor, the psi gradient and its flag."""
        server = self.require_server()
        extras = {
            L.DESCRIPTOR: torch.zeros(server.descriptors.shape[1]),
            L.HAS_GRADIENT: torch.zeros(1),
            **{
                L.EMBEDDING_GRAD + n: p.detach().cpu()
                for n, p in server.embedding.named_parameters()
            },
        }
        return tensor_spec({**self.initial_generated, **extras})

    def aggregate(
        self, server_round: int, replies: list[ClientReply], inputs: RoundInputs = PLAIN_ROUND
    ) -> dict[str, float]:
        """One step of both networks from the round's replies; its statistics."""
        server = self.require_server()
        updates = {r.client_id: {n: r.arrays[n] for n in self.initial_generated} for r in replies}
        descriptors = {r.client_id: r.arrays[L.DESCRIPTOR] for r in replies}
        gradients = {
            r.client_id: {
                n[len(L.EMBEDDING_GRAD) :]: t
                for n, t in r.arrays.items()
                if n.startswith(L.EMBEDDING_GRAD)
            }
            for r in replies
            if float(r.arrays[L.HAS_GRADIENT][0]) > 0.5
        }
        metrics = server.step(server_round, updates, descriptors, gradients)
        log.info("pefll round %d: %s", server_round, brief(metrics))
        return metrics
