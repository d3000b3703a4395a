"""How FedAvg's global tensors are updated from a round's validated replies, chosen at build.

``averaging_parts`` picks, from the run config, the exchange (``strategies.parts.exchange``) and
the update of ``FedAvgStrategy``, as Flower composes DP as a strategy wrapper and SecAgg+ as a
workflow:

* ``WeightedAverage``: each tensor averaged over the clients that sent it, weighted by examples
  or uniformly (``fedfm_flower.learners.aggregation``), in float64 and cast back, so the result
  does not depend on the order replies arrive in; it reports the median norm of the clients' updates
  (``update-norm-median``, what a ``dp-clipping-norm`` is chosen against).
* ``DPFedAvg`` (``dp = central``): the updates (reply - global) clipped to ``dp-clipping-norm``
  (again here, so the bound does not rest on the clients), summed with equal weights, divided
  by the m clients sampled for the round (``RoundInputs.sampled``) and noised with
  N(0, (sigma C / m)^2) per coordinate, fresh noise no one can regenerate
  (``fedfm_flower.privacy.noise``); each such average is a release, counted by the strategy's
  ``CentralReleases`` (``strategies.parts.accounting``), which gives the round's epsilon.
* ``SecureMeanUpdate`` (``secagg = true``): the global tensors plus the weighted mean update
  SecAgg+ unmasked (``RoundInputs.secure_mean``), kept only when the sum holds exactly the
  validated replies' clients; a round that did not travel under SecAgg+ (post-training) is
  averaged as without it.

An update takes the global tensors and returns the new ones with the round's server metrics.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Protocol

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.learners.aggregation import average_over_owners, client_weights
from fedfm_flower.privacy import accountant, mechanism
from strategies.parts.accounting import CentralReleases, ReleaseAccounting
from strategies.parts.exchange import Exchange, RoundInputs, exchange_for
from strategies.parts.replies import ClientReply

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


class GlobalUpdate(Protocol):
    """How the global tensors follow from a round's validated replies."""

    def apply(
        self, server_round: int, tensors: Tensors, replies: list[ClientReply], inputs: RoundInputs
    ) -> tuple[Tensors, dict[str, float]]:
        """The new global tensors and the round's server metrics."""
        ...


@dataclass(frozen=True)
class WeightedAverage:
    """FedAvg: each tensor averaged over its senders, clients weighted by ``weighting``."""

    weighting: str

    def apply(
        self, server_round: int, tensors: Tensors, replies: list[ClientReply], inputs: RoundInputs
    ) -> tuple[Tensors, dict[str, float]]:
        """The weighted average per tensor; the median norm of the clients' updates."""
        if not tensors:
            return tensors, {}
        weights = client_weights([r.num_examples for r in replies], self.weighting)
        norms = [mechanism.update_norm(r.arrays, tensors) for r in replies]
        averaged = average_over_owners([r.arrays for r in replies], weights)
        # the size of the clients' updates: what a dp-clipping-norm is chosen against
        return {**tensors, **averaged}, {"update-norm-median": statistics.median(norms)}


@dataclass(frozen=True)
class DPFedAvg:
    """DP-FedAvg: global + (sum of clipped updates) / m + N(0, (sigma C / m)^2), a release
    counted by ``releases``."""

    config: ExperimentConfig
    releases: CentralReleases

    def apply(
        self, server_round: int, tensors: Tensors, replies: list[ClientReply], inputs: RoundInputs
    ) -> tuple[Tensors, dict[str, float]]:
        """The noised average; the round's release metrics (no statistic of the unnoised
        updates)."""
        if not tensors:
            return tensors, {}
        config = self.config
        sampled = max(inputs.sampled, len(replies))
        totals = {n: torch.zeros(t.shape, dtype=torch.float64) for n, t in tensors.items()}
        for reply in replies:  # validated: only global tensors' names (reply_spec)
            deltas = mechanism.clipped_deltas(reply.arrays, tensors, config.dp_clipping_norm)
            for name, delta in deltas.items():
                totals[name] += delta
        sigma = accountant.noise_multiplier(config)
        std = mechanism.noise_std(sigma, config.dp_clipping_norm, sampled)
        noised = mechanism.add_gaussian_noise(
            {n: total / sampled for n, total in totals.items()}, std
        )
        updated = {
            n: (tensors[n].to(torch.float64) + step).to(tensors[n].dtype)
            for n, step in noised.items()
        }
        return updated, self.releases.release(server_round, std)


@dataclass(frozen=True)
class SecureMeanUpdate:
    """SecAgg+: global + the unmasked weighted mean update; ``plain`` for a round that did not
    travel under SecAgg+."""

    plain: GlobalUpdate

    def apply(
        self, server_round: int, tensors: Tensors, replies: list[ClientReply], inputs: RoundInputs
    ) -> tuple[Tensors, dict[str, float]]:
        """The global tensors moved by the mean update, when the sum holds exactly the
        validated replies' clients (a rejected reply's update cannot be taken out of it);
        unchanged otherwise."""
        if not inputs.under_secagg:
            return self.plain.apply(server_round, tensors, replies, inputs)
        secure = inputs.secure_mean
        if secure is None:
            log.warning("round %s: SecAgg+ gave no aggregate; state unchanged", server_round)
            return tensors, {}
        accepted = {r.node_id for r in replies}
        if set(secure.nodes) != accepted:
            log.warning(
                "round %s: SecAgg+ summed nodes %s but the valid replies came from %s; the sum "
                "is discarded, state unchanged",
                server_round,
                sorted(secure.nodes),
                sorted(accepted),
            )
            return tensors, {"secagg-clients": 0.0}
        if set(secure.update) != set(tensors):
            raise ValueError("SecAgg+ aggregate does not hold the global tensors")
        updated = {
            n: (t.to(torch.float64) + secure.update[n]).to(t.dtype) for n, t in tensors.items()
        }
        # sum of w / secagg-max-weight: with a mean far below 1 the step is coarse (docs/privacy.md)
        metrics = {"secagg-clients": float(len(accepted)), "secagg-weight": secure.total_weight}
        return updated, metrics


def averaging_parts(
    config: ExperimentConfig, releases: ReleaseAccounting, weighting: str
) -> tuple[Exchange, GlobalUpdate]:
    """FedAvg's exchange and update for ``config``: SecAgg+'s (``secagg``), DP-FedAvg's over
    a plain exchange (``dp = central``; ``releases`` must count central releases), else the
    weighted average; clients weighted by ``weighting``."""
    average = WeightedAverage(weighting)
    exchange = exchange_for(config, weighting)
    if config.secagg:
        return exchange, SecureMeanUpdate(average)
    if config.dp == "central":
        if not isinstance(releases, CentralReleases):
            raise TypeError(f"dp = 'central' needs central release accounting, not {releases}")
        return exchange, DPFedAvg(config, releases)
    return exchange, average
