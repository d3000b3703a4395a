"""APPLE as a Flower strategy (Luo & Wu 2022): one core slot per client, every core to every
client.

The server keeps each client's latest core theta_j (the tensors its last training reply held;
the run's seeded initial tensors until it has sent one) and never sees a directed relationship
vector. Client i is sent all N cores: its own under the plain parameter names (the base its
reply is clipped and noised around under local DP), every other client's under
``fedfm_flower.methods.apple.core_key``. A reply replaces its sender's slot, and nothing else
changes. N and client ids: see ``strategies.client_slots``.
"""

from __future__ import annotations

import functools
import logging

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.apple import core_key
from fedfm_flower.models import TrainableTensors
from fedfm_flower.records.messages import tensor_spec
from strategies.client_slots import ClientSlotStrategy
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.exchange import PLAIN_ROUND, RoundInputs
from strategies.parts.replies import ClientReply

log = logging.getLogger(__name__)

STATE_PREFIX = "core."  # checkpoint key of client j's core tensor n: "core.<j>.<n>"


class AppleCores:
    """Every client's latest core, the whole server state of APPLE."""

    def __init__(self, initial: dict[str, torch.Tensor], num_clients: int) -> None:
        self.names = list(initial)
        self.cores = [{n: t.clone() for n, t in initial.items()} for _ in range(num_clients)]

    @property
    def num_clients(self) -> int:
        """N: the number of slots."""
        return len(self.cores)

    def payload(self, client_id: int) -> dict[str, torch.Tensor]:
        """Client ``client_id``'s own core under its names, every other core under
        ``core_key``."""
        tensors = dict(self.cores[client_id])
        for j, core in enumerate(self.cores):
            if j != client_id:
                tensors.update({core_key(j, n): t for n, t in core.items()})
        return tensors

    def store(self, client_id: int, tensors: dict[str, torch.Tensor]) -> None:
        """Put ``tensors`` in client ``client_id``'s slot."""
        self.cores[client_id] = {n: tensors[n].detach().cpu().clone() for n in self.names}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every slot's tensors, keyed ``core.<j>.<name>``."""
        slots = enumerate(self.cores)
        return {f"{STATE_PREFIX}{j}.{n}": t for j, core in slots for n, t in core.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the slots written by ``state_tensors`` (the same N and tensor names)."""
        if set(tensors) != set(self.state_tensors()):
            raise ValueError("checkpoint tensors do not match this APPLE configuration")
        self.cores = [
            {n: tensors[f"{STATE_PREFIX}{j}.{n}"].clone() for n in self.names}
            for j in range(self.num_clients)
        ]


class AppleStrategy(ClientSlotStrategy):
    """One core per client, stored as sent and passed to every client."""

    def __init__(
        self, config: ExperimentConfig, initial: TrainableTensors, context: RunContext = NO_CONTEXT
    ) -> None:
        self.initial = initial
        super().__init__(config, initial, context)

    @functools.cached_property
    def initial_core(self) -> dict[str, torch.Tensor]:
        """The initial core: the method's shared split (every trainable tensor) of the initial
        tensors."""
        shared = self.method.split_names(self.initial.groups)[0]
        return {n: self.initial.tensors[n].clone() for n in shared}

    def build_server(self, num_clients: int) -> AppleCores:
        """``num_clients`` slots, each at the initial core."""
        size = sum(t.numel() for t in self.initial_core.values())
        log.info("APPLE: %d clients, cores of %d parameters each", num_clients, size)
        return AppleCores(self.initial_core, num_clients)

    def num_clients_in(self, tensors: dict[str, torch.Tensor]) -> int:
        """N = distinct slots in the checkpoint."""
        return len({k[len(STATE_PREFIX) :].split(".", 1)[0] for k in tensors})

    def train_payload(self, client_id: int, server_round: int) -> dict[str, torch.Tensor]:
        """All N cores, the client's own under the plain names."""
        return self.require_server().payload(client_id)

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """A reply is the client's core."""
        return tensor_spec(self.initial_core)

    def aggregate(
        self, server_round: int, replies: list[ClientReply], inputs: RoundInputs = PLAIN_ROUND
    ) -> dict[str, float]:
        """Each reply's core into its sender's slot; no server metrics."""
        server = self.require_server()
        for reply in replies:
            server.store(reply.client_id, reply.arrays)
        return {}
