"""FedAvg over the shared parameter groups, each tensor averaged over the clients that sent it.

A client gets and sends the shared tensors of the components it owns: all of them for most
models; for a model whose components serve only some holdings (TAP's modality-task pairs,
``TunedModel.group_users``), those of its holdings, so a component is averaged over the clients
that own it (TAP's component-wise FedAvg, eq. 1).

What is shared and what stays on the clients is the method's split (``MethodSpec.split`` in
``fedfm_flower/methods/<method>.py``, resolved once per run: ``self.method``, a
``fedfm_flower.methods.registry.ResolvedMethod``, as the clients read it); subclasses choose how
clients are weighted (``weighting``: example counts, or equal as FedDPA's eq. 2) and add phases.

How the global tensors follow from a round's replies is a part chosen at build from the run
config (``strategies.parts.averaging``): the weighted average in float64 (the result does not
depend on the order replies arrive in), DP-FedAvg's noised average of clipped updates under
``dp = "central"``, or the SecAgg+ mean update under ``secagg = true``, whose exchange the
strategy composes with it (``strategies.parts.exchange``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models import TrainableTensors
from fedfm_flower.records.messages import tensor_spec
from strategies.base import PersonalizedStrategy
from strategies.parts.averaging import averaging_parts
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.exchange import PLAIN_ROUND, RoundInputs
from strategies.parts.replies import ClientReply


class FedAvgStrategy(PersonalizedStrategy):
    """One global copy of the shared groups, averaged over the reporting clients."""

    weighting: ClassVar[str] = "examples"

    def __init__(
        self, config: ExperimentConfig, initial: TrainableTensors, context: RunContext = NO_CONTEXT
    ) -> None:
        super().__init__(config, initial, context)
        shared, _ = self.split(initial)
        self.global_tensors = {n: initial.tensors[n].clone() for n in shared}
        # Which tensors serve which holdings (TAP's components); the values are not kept.
        self.layout = TrainableTensors({}, initial.groups, initial.users)
        # How the global tensors follow from the replies, and how the replies travel (chosen
        # from the run config: weighted average, DP-FedAvg, or SecAgg+'s mean and exchange).
        self.exchanger, self.update = averaging_parts(config, self.privacy, self.client_weighting())

    def owned(self, client_id: int) -> dict[str, torch.Tensor]:
        """The global tensors of the components ``client_id`` owns (all, for most models)."""
        names = self.layout.names_for(self.nodes.holdings_of(client_id))
        return {n: self.global_tensors[n] for n in names if n in self.global_tensors}

    def client_weighting(self) -> str:
        """How replies are weighted (``fedfm_flower.learners.aggregation.WEIGHTINGS``): the class's
        ``weighting`` unless a method's setting chooses."""
        return self.weighting

    def split(self, initial: TrainableTensors) -> tuple[list[str], list[str]]:
        """(shared, local) parameter names: the method's split (the clients read the same)."""
        return self.method.split_names(initial.groups)

    def train_payload(self, client_id: int, server_round: int) -> dict[str, torch.Tensor]:
        """The global shared tensors of the client's components (for most models: all)."""
        return self.owned(client_id)

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Replies carry the client's shared tensors, shaped like the global ones."""
        return tensor_spec(self.owned(client_id))

    def aggregate(
        self, server_round: int, replies: list[ClientReply], inputs: RoundInputs = PLAIN_ROUND
    ) -> dict[str, float]:
        """The global tensors updated from the replies by the part chosen at build
        (``self.update``: the weighted average per tensor over its senders, eq. 1 of pFedSeq,
        FedAvg; DP-FedAvg's; or the SecAgg+ mean update); its server metrics. A post-training
        round's replies carry no tensors (FedDPA-F's fine-tuning, TAP's distillation): the
        global tensors stay, and under central DP nothing is released."""
        if self.phase(server_round) == "post-training":
            return {}
        self.global_tensors, metrics = self.update.apply(
            server_round, self.global_tensors, replies, inputs
        )
        return metrics

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The global shared tensors."""
        return {f"global.{k}": v for k, v in self.global_tensors.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the global shared tensors."""
        expected = set(self.state_tensors())
        if set(tensors) != expected:
            raise ValueError("checkpoint tensors do not match this FedAvg configuration")
        self.global_tensors = {k[len("global.") :]: v.clone() for k, v in tensors.items()}
