"""FedAvg over the shared parameter groups, each tensor averaged over the clients that sent it.

A client gets and sends the shared tensors of the components it owns: all of them for most
models; for a model whose components serve only some holdings (TAP's modality-task pairs,
``TunedModel.group_users``), those of its holdings, so a component is averaged over the clients
that own it (TAP's component-wise FedAvg, eq. 1).

The global tensors are averaged in float64 and cast back, so the result does not depend on the
order replies arrive in. What is shared and what stays on the clients is the method's split
(``MethodSpec.split`` in ``fedfm_flower/methods/<method>.py``, resolved once per run:
``self.method``, a ``fedfm_flower.registry.ResolvedMethod``, as the clients read it); subclasses
choose how clients are weighted (``weighting``: example counts, or equal as FedDPA's eq. 2) and
add phases.

With ``dp = "central"`` (``fedfm_flower.privacy``) the average is DP-FedAvg's instead: the
updates (reply - global) clipped to ``dp-clipping-norm`` (again here, so the bound does not rest
on the clients), summed with equal weights, divided by the number of clients sampled for the
round and noised with N(0, (sigma C / m)^2) per coordinate, fresh noise no one can regenerate
(``privacy.noise``); each such round is a release, counted in the strategy's ledger
(``privacy.ledger``), and the privacy spent so far is in the round's server metrics
(``dp-epsilon`` at ``dp-delta``).

With ``secagg = true`` (``fedfm_flower.privacy.secagg``) the replies hold no tensors: the round's
SecAgg+ protocol gives the weighted mean of the clients' updates, which is added to the global
tensors (``aggregate_secure``), the same as averaging the trained tensors up to quantization.
"""

from __future__ import annotations

import logging
import statistics
from typing import TYPE_CHECKING, ClassVar

import torch

from fedfm_flower.aggregation import average_over_owners, client_weights
from fedfm_flower.config import ExperimentConfig
from fedfm_flower.models import TrainableTensors
from fedfm_flower.privacy import accountant, mechanism
from fedfm_flower.records import tensor_spec
from strategies.base import PersonalizedStrategy
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.replies import ClientReply

if TYPE_CHECKING:
    from fedfm_flower.privacy.secagg import SecureMean

log = logging.getLogger(__name__)


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

    def owned(self, client_id: int) -> dict[str, torch.Tensor]:
        """The global tensors of the components ``client_id`` owns (all, for most models)."""
        names = self.layout.names_for(self.nodes.holdings_of(client_id))
        return {n: self.global_tensors[n] for n in names if n in self.global_tensors}

    def client_weighting(self) -> str:
        """How replies are weighted (``fedfm_flower.aggregation.WEIGHTINGS``): the class's
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

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """Average of the replies per tensor over its senders (eq. 1 of pFedSeq, FedAvg); the
        median norm of the clients' updates of the shared tensors (not under DP: a statistic of
        unnoised updates)."""
        if not self.global_tensors:
            return {}
        if self.config.dp == "central":
            return self.aggregate_privately(server_round, replies)
        weights = client_weights([r.num_examples for r in replies], self.client_weighting())
        norms = [mechanism.update_norm(r.arrays, self.global_tensors) for r in replies]
        averaged = average_over_owners([r.arrays for r in replies], weights)
        self.global_tensors = {**self.global_tensors, **averaged}
        # the size of the clients' updates: what a dp-clipping-norm is chosen against
        return {"update-norm-median": statistics.median(norms)}

    def aggregate_secure(
        self, server_round: int, replies: list[ClientReply], secure: SecureMean
    ) -> dict[str, float]:
        """global + the SecAgg+ weighted mean update; kept only when the sum holds exactly the
        validated replies' clients (a rejected reply's update cannot be taken out of it)."""
        accepted = {r.node_id for r in replies}
        if set(secure.nodes) != accepted:
            log.warning(
                "round %s: SecAgg+ summed nodes %s but the valid replies came from %s; the sum "
                "is discarded, state unchanged",
                server_round,
                sorted(secure.nodes),
                sorted(accepted),
            )
            return {"secagg-clients": 0.0}
        if set(secure.update) != set(self.global_tensors):
            raise ValueError("SecAgg+ aggregate does not hold the global tensors")
        self.global_tensors = {
            n: (t.to(torch.float64) + secure.update[n]).to(t.dtype)
            for n, t in self.global_tensors.items()
        }
        # sum of w / secagg-max-weight: with a mean far below 1 the step is coarse (docs/privacy.md)
        return {"secagg-clients": float(len(accepted)), "secagg-weight": secure.total_weight}

    def aggregate_privately(
        self, server_round: int, replies: list[ClientReply]
    ) -> dict[str, float]:
        """DP-FedAvg: global + (sum of clipped updates) / m + N(0, (sigma C / m)^2); the
        round's noise and the privacy spent after it."""
        config = self.config
        sampled = max(len(self._training.train.sent), len(replies))
        totals = {
            n: torch.zeros(t.shape, dtype=torch.float64) for n, t in self.global_tensors.items()
        }
        for reply in replies:  # validated: only global tensors' names (reply_spec)
            clipped = mechanism.clip_update(
                reply.arrays, self.global_tensors, config.dp_clipping_norm
            )
            for name, tensor in clipped.items():
                totals[name] += tensor.double() - self.global_tensors[name].double()
        sigma = accountant.noise_multiplier(config)
        std = mechanism.noise_std(sigma, config.dp_clipping_norm, sampled)
        noised = mechanism.add_gaussian_noise(
            {n: total / sampled for n, total in totals.items()}, std
        )
        self.global_tensors = {
            n: (self.global_tensors[n].to(torch.float64) + step).to(self.global_tensors[n].dtype)
            for n, step in noised.items()
        }
        self.releases.record(server_round)
        return accountant.release_metrics(config, self.releases.count, std)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The global shared tensors."""
        return {f"global.{k}": v for k, v in self.global_tensors.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the global shared tensors."""
        expected = set(self.state_tensors())
        if set(tensors) != expected:
            raise ValueError("checkpoint tensors do not match this FedAvg configuration")
        self.global_tensors = {k[len("global.") :]: v.clone() for k, v in tensors.items()}
