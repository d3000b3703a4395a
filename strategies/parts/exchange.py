"""How a round's messages travel and their replies come back, chosen when the strategy is built.

The runner hands a round's messages to ``strategy.exchange`` and the result to
``strategy.aggregate_round``; it does not know which exchange ran. ``PlainExchange`` is Flower's
``grid.send_and_receive``. ``SecAggExchange`` (``secagg = true``) runs a federated round's
training under SecAgg+ (``fedfm_flower.privacy.secagg.secure_exchange``, the server side of
Flower's ``secaggplus_mod``): the training replies hold no tensors, and the result carries the
weighted mean update the protocol unmasked, for an aggregation that can take it
(``strategies.parts.averaging.SecureMeanUpdate``), and the protocol's own traffic (keys, shares,
masked vectors) as the round record's ``bytes-down-secagg`` / ``bytes-up-secagg``. A
post-training round travels plainly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from fedfm_flower.privacy.secagg import SecAggSettings, SecureMean, secure_exchange
from strategies.parts.replies import NO_ARRAYS, ReplySpec

if TYPE_CHECKING:
    from flwr.app import Message
    from flwr.serverapp import Grid

    from fedfm_flower.config.experiment import ExperimentConfig


@dataclass(frozen=True)
class Exchanged:
    """A round's replies as they came back: ``under_secagg`` when its training travelled under
    SecAgg+ (the training replies hold no tensors; ``secure_mean`` is what the protocol
    unmasked, None when it could not finish), and ``traffic``, the round record's entries for
    the exchange's own bytes beyond the messages (none for a plain exchange)."""

    replies: list[Message]
    under_secagg: bool = False
    secure_mean: SecureMean | None = None
    traffic: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, replies: Exchanged | Iterable[Message]) -> Exchanged:
        """``replies`` as an exchange's result (a plain one for bare messages)."""
        return replies if isinstance(replies, Exchanged) else cls(list(replies))

    def reply_spec(self, spec: ReplySpec) -> ReplySpec:
        """What a training reply must hold: ``spec`` (the strategy's), no tensors under
        SecAgg+ (they travelled masked)."""
        return NO_ARRAYS if self.under_secagg else spec

    def inputs(self, sampled: int) -> RoundInputs:
        """What the aggregation of this exchange's round reads besides the replies, with
        ``sampled`` clients sent a training message."""
        return RoundInputs(sampled, self.under_secagg, self.secure_mean)


@dataclass(frozen=True)
class RoundInputs:
    """What a strategy's ``aggregate`` reads of its round besides the validated replies: how
    many clients were sent a training message (the round's report; DP-FedAvg's fixed
    denominator m), whether the replies travelled under SecAgg+ and the mean update it
    unmasked. The default: no sample known (the replies' count serves), a plain exchange."""

    sampled: int = 0
    under_secagg: bool = False
    secure_mean: SecureMean | None = None


PLAIN_ROUND = RoundInputs()  # a round's inputs when only its replies are known


class Exchange(Protocol):
    """How a round's messages travel (``PlainExchange``, ``SecAggExchange``)."""

    def exchange(self, grid: Grid, messages: Sequence[Message], phase: str) -> Exchanged:
        """Send ``messages`` (of a round in ``phase``) and collect their replies."""
        ...


@dataclass(frozen=True)
class PlainExchange:
    """Flower's ``send_and_receive``, waiting up to ``timeout`` seconds."""

    timeout: float | None

    def exchange(self, grid: Grid, messages: Sequence[Message], phase: str) -> Exchanged:
        """The replies to ``messages``."""
        return Exchanged(list(grid.send_and_receive(messages, timeout=self.timeout)))


@dataclass(frozen=True)
class SecAggExchange:
    """A federated round's training under SecAgg+ with ``settings``, the clients weighted by
    ``weighting``; a post-training round as ``PlainExchange``."""

    settings: SecAggSettings
    timeout: float | None
    weighting: str

    def exchange(self, grid: Grid, messages: Sequence[Message], phase: str) -> Exchanged:
        """The replies, the unmasked mean update and the protocol's traffic."""
        if phase != "train":
            return PlainExchange(self.timeout).exchange(grid, messages, phase)
        secure = secure_exchange(grid, messages, self.settings, self.timeout, self.weighting)
        traffic = {"bytes-down-secagg": secure.bytes_down, "bytes-up-secagg": secure.bytes_up}
        return Exchanged(secure.replies, True, secure.mean, traffic)


def exchange_for(config: ExperimentConfig, weighting: str) -> Exchange:
    """The exchange of a strategy that can aggregate a SecAgg+ mean: SecAgg+'s under
    ``secagg``, else plain; clients weighted by ``weighting``."""
    if not config.secagg:
        return PlainExchange(config.round_timeout)
    return SecAggExchange(SecAggSettings.of(config), config.round_timeout, weighting)
