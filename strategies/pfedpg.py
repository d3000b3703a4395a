"""pFedPG as a Flower strategy: client-specific prompts from ``fedfm_flower.learners.pfedpg``.

Clients send the change of their prompts Delta P_n (never heads); each client is sent its own
generated prompts P_n only. N and client ids: see ``strategies.client_slots``.
"""

from __future__ import annotations

import logging

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.learners.pfedpg import PFedPGServer, PFedPGSettings
from fedfm_flower.models import TrainableTensors, pick_device
from fedfm_flower.records.messages import tensor_spec
from strategies.client_slots import ClientSlotStrategy, brief
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.exchange import PLAIN_ROUND, RoundInputs
from strategies.parts.replies import ClientReply

log = logging.getLogger(__name__)


class PFedPGStrategy(ClientSlotStrategy):
    """A prompt generator trained with the clients' prompt changes as gradient proxies."""

    def __init__(
        self, config: ExperimentConfig, initial: TrainableTensors, context: RunContext = NO_CONTEXT
    ) -> None:
        prompts = initial.select(["prompt"])
        if len(prompts) != 1:
            raise ValueError("pFedPG needs the vpt tuner's single prompt tensor")
        ((self.prompt_name, tensor),) = prompts.items()
        if tensor.shape[0] != 1:
            raise ValueError("pFedPG generates VPT-shallow prompts (one prompt set)")
        self.prompt_shape = tuple(tensor.shape)
        self.initial_prompts = tensor[0].clone()
        self.settings = config.settings_of(PFedPGSettings)
        super().__init__(config, initial, context)

    def build_server(self, num_clients: int) -> PFedPGServer:
        """Generator, basis and descriptors for ``num_clients`` clients."""
        server = PFedPGServer(
            self.settings,
            self.initial_prompts,
            num_clients,
            seed=self.config.seed,
            device=pick_device(self.config.device),
        )
        log.info(
            "pFedPG: %d clients, %s generator (%s queries), K = %d prompts of width %d",
            num_clients,
            self.settings.generator,
            self.settings.query,
            *self.initial_prompts.shape,
        )
        return server

    def num_clients_in(self, tensors: dict[str, torch.Tensor]) -> int:
        """N = descriptors in the checkpoint."""
        return sum(1 for k in tensors if k.startswith("generator.descriptors."))

    def train_payload(self, client_id: int, server_round: int) -> dict[str, torch.Tensor]:
        """P_n for client n only."""
        prompts = self.require_server().prompts_for(client_id)
        return {self.prompt_name: prompts.reshape(self.prompt_shape)}

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """A reply is the prompt change, shaped like the prompts."""
        return tensor_spec({self.prompt_name: torch.zeros(self.prompt_shape)})

    def aggregate(
        self, server_round: int, replies: list[ClientReply], inputs: RoundInputs = PLAIN_ROUND
    ) -> dict[str, float]:
        """One generator step (eqs. 4, 5) from the reporting clients' prompt changes; its
        statistics."""
        server = self.require_server()
        updates = {r.client_id: r.arrays[self.prompt_name][0] for r in replies}
        metrics = server.step(updates)
        log.info("pfedpg round %d: %s", server_round, brief(metrics))
        return metrics
