"""The shared base of every personalized strategy in fedfm-flower.

A ``PersonalizedStrategy`` is a Flower ``Strategy`` whose state lives in the strategy, keyed by
the clients' *stable* ids. It keeps the method hooks (payloads, reply specs, ``aggregate``,
state, phases) and joins the parts it is composed of (``strategies.parts``: node directory,
sampler, messages, reply validation, fused rounds, outcomes):

* **Run facts** come with the constructor (``RunContext``), never by attribute writes; the
  run's method, resolved once by the runner (``RunContext.method``), is ``self.method``.
* **Privacy parts**, chosen at build from the run config: ``self.exchanger``, how a round's
  messages travel (``strategies.parts.exchange``: plain here; a strategy that can aggregate a
  SecAgg+ mean composes SecAgg+'s, as ``FedAvgStrategy`` does), and ``self.privacy``, the count
  of DP releases (``strategies.parts.accounting``: none, local or central). The runner calls
  ``configure_round``, ``exchange`` and ``aggregate_round`` whatever they are.
* **Outcomes.** ``aggregate_round`` returns a ``RoundOutcome`` (training report and means, the
  evaluation it carried, ``aggregate``'s server metrics), ``aggregate_evaluation`` a
  ``PhaseOutcome``; the runner records from these. Flower's ``configure_*``/``aggregate_*``
  are thin wrappers, so the strategy stays a Flower ``Strategy``.
* **State.** ``state_dict()`` returns ``(tensors, meta)`` (meta names the strategy class and
  the method), restored exactly by ``load_state_dict``, which refuses another method's state.
* **Post-training phase.** ``post_training_rounds()`` > 0 adds rounds after the last federated
  round (FedDPA-F's local fine-tuning, TAP's distillation), run and checkpointed like any round;
  their messages go to every identified client, say ``phase = post-training``, and the
  ClientApp calls the method's ``post_train``. ``phase(round)`` tells a round's phase;
  ``current_round`` is the round being configured.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.registry import ResolvedMethod, resolve
from fedfm_flower.models import TrainableTensors
from strategies.parts.accounting import accounting_for
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.exchange import (
    PLAIN_ROUND,
    Exchange,
    Exchanged,
    PlainExchange,
    RoundInputs,
)
from strategies.parts.fused import FusedRound
from strategies.parts.messages import Payload, per_node_messages
from strategies.parts.nodes import NodeDirectory
from strategies.parts.outcome import PhaseOutcome, RoundOutcome, RoundReport
from strategies.parts.replies import ClientReply, reply_part, validate
from strategies.parts.sampling import ClientSampler

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fedfm_flower.privacy.ledger import ReleaseLedger

log = logging.getLogger(__name__)


def resolved_method(config: ExperimentConfig, context: RunContext) -> ResolvedMethod:
    """The run's resolved method: the context's (the runner resolved it), else ``config``'s
    resolved here; a context resolved for another method is an error."""
    if context.method is None:
        return resolve(config)
    if context.method.name != config.method:
        raise ValueError(
            f"run context resolved method '{context.method.name}' for a '{config.method}' config"
        )
    return context.method


class PersonalizedStrategy(Strategy):
    """Base of the method strategies: the method hooks, composed with the strategy parts."""

    # Whether round t's evaluation of a client equals evaluating, before training, on round
    # t + 1's training message; False keeps evaluation in a phase of its own.
    fused_evaluation: ClassVar[bool] = True

    def __init__(
        self, config: ExperimentConfig, initial: TrainableTensors, context: RunContext = NO_CONTEXT
    ) -> None:
        self.config = config
        self.context = context
        self.method = resolved_method(config, context)
        self.nodes = NodeDirectory(context.run_name, context.client_holdings)
        self.sampler = ClientSampler(config, context.client_tasks, self.nodes.data_key)
        self.current_round = 0  # the round configure_train was last called for
        self._training = FusedRound(RoundReport())  # the training phase in flight
        self._evaluation = RoundReport()  # the evaluation phase in flight
        self.privacy = accounting_for(config)  # the DP releases so far (dp = none: none)
        self.exchanger: Exchange = PlainExchange(config.round_timeout)

    # ----------------------------------------------------------------- to implement
    def train_payload(self, client_id: int, server_round: int) -> dict[str, torch.Tensor]:
        """Tensors sent to ``client_id`` for training in ``server_round``."""
        raise NotImplementedError

    def evaluate_payload(self, client_id: int, server_round: int) -> dict[str, torch.Tensor]:
        """Tensors sent to ``client_id`` for evaluation; by default its training payload."""
        return self.train_payload(client_id, server_round + 1)

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Names, shapes and dtypes a training reply of ``client_id`` must have."""
        raise NotImplementedError

    def aggregate(
        self, server_round: int, replies: list[ClientReply], inputs: RoundInputs = PLAIN_ROUND
    ) -> dict[str, float]:
        """Update the strategy state from the validated training replies (``inputs``: how
        many clients were sampled, and how the replies travelled); the server's own numbers of
        the round (``{}``: none)."""
        raise NotImplementedError

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of the strategy state."""
        raise NotImplementedError

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the tensors of the strategy state."""
        raise NotImplementedError

    def refuse_client(self, client_id: int) -> str | None:
        """Why this strategy cannot serve ``client_id`` (None: it can); asked once per node."""
        return None

    def required_reply_keys(self, client_id: int) -> set[str] | None:
        """Keys of ``reply_spec`` a reply must hold (None: all); the others may be left out,
        as by clients that own only some components. Post-training replies need none."""
        return set() if self.phase(self.current_round) == "post-training" else None

    def post_training_rounds(self) -> int:
        """Rounds of the post-training phase after the last federated round (0: none)."""
        return 0

    def phase(self, server_round: int) -> str:
        """'train' for the federated rounds, 'post-training' for the rounds after them."""
        return "train" if server_round <= self.config.num_server_rounds else "post-training"

    def fuses_evaluation(self) -> bool:
        """Whether round t's evaluation may ride on round t + 1's training messages: the
        strategy does not opt out and its evaluation payload is the default, round t + 1's
        training payload (computed after round t's aggregation, as the evaluation's was)."""
        own_payload = type(self).evaluate_payload is not PersonalizedStrategy.evaluate_payload
        return self.fused_evaluation and not own_payload

    # ----------------------------------------------------------------- clients
    def learn_node_mapping(self, grid: Grid, server_round: int) -> None:
        """Query nodes not seen before for their client id; forget nodes that left."""
        self.nodes.learn(grid, server_round, self.refuse_client)

    def clients(self) -> list[int]:
        """Client ids of the nodes currently connected and identified."""
        return self.nodes.clients()

    def train_clients(self, server_round: int) -> list[int]:
        """Who trains in ``server_round``: a ``fraction-train`` sample, everyone in the
        post-training phase."""
        post_training = self.phase(server_round) == "post-training"
        fraction = 1.0 if post_training else self.config.fraction_train
        return self.sampler.sample(self.clients(), server_round, fraction)

    def evaluate_clients(self, server_round: int) -> list[int]:
        """Who evaluates in ``server_round``: a seeded ``fraction-evaluate`` sample."""
        fraction = self.config.fraction_evaluate
        return self.sampler.sample(self.clients(), server_round, fraction, salt=1)

    # ----------------------------------------------------------------- a round
    def configure_round(
        self, server_round: int, evaluate_round: int | None, grid: Grid
    ) -> list[Message]:
        """Round ``server_round``'s training messages with ``evaluate_round``'s evaluation fused
        in (none when it is None): the sampled evaluators that train get ``evaluate-round`` in
        their training message's config, the others round ``evaluate_round``'s evaluate
        message."""
        messages = list(self.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))
        if evaluate_round is None:
            return messages
        evaluated = self.evaluate_clients(evaluate_round)
        alone = self._training.carry(messages, evaluate_round, evaluated)
        return messages + self._messages(
            alone, evaluate_round, MessageType.EVALUATE, self.evaluate_payload, ConfigRecord()
        )

    def exchange(self, grid: Grid, messages: Sequence[Message], server_round: int) -> Exchanged:
        """Send ``configure_round(server_round, ...)``'s messages and collect the replies, by
        the exchange chosen at build (plain, or SecAgg+ for a federated round's training)."""
        return self.exchanger.exchange(grid, messages, self.phase(server_round))

    def aggregate_round(
        self,
        server_round: int,
        evaluate_round: int | None,
        replies: Exchanged | Iterable[Message],
    ) -> RoundOutcome:
        """Validate and aggregate the replies to ``configure_round(server_round,
        evaluate_round)``'s messages (``exchange``'s result, or bare replies of a plain
        exchange): the training outcome, ``evaluate_round``'s evaluation (None when it is None)
        and the server metrics of the aggregation (with the round's release metrics)."""
        exchanged = Exchanged.of(replies)
        flight, client_of = self._training, self.nodes.node_to_client
        training, evaluation = flight.sort(exchanged.replies, client_of)
        valid = validate(training, flight.train, client_of, exchanged.reply_spec(self))
        server_metrics: dict[str, float] = {}
        if valid or (self.privacy.releases_without_replies and flight.train.sent):
            if not valid:
                log.warning(
                    "round %s: no valid training reply; under central DP the noised mean of no "
                    "update is released",
                    server_round,
                )
            inputs = exchanged.inputs(len(flight.train.sent))
            server_metrics = self.aggregate(server_round, valid, inputs)
        else:
            log.warning("round %s: no valid training reply; state unchanged", server_round)
        server_metrics = {**server_metrics, **self.privacy.round_metrics()}
        train = PhaseOutcome.of(flight.train)
        if evaluate_round is None or flight.evaluation is None:
            return RoundOutcome(train, None, server_metrics)
        validate(evaluation, flight.evaluation, client_of, None)
        return RoundOutcome(train, PhaseOutcome.of(flight.evaluation), server_metrics)

    def aggregate_evaluation(self, server_round: int, replies: Iterable[Message]) -> PhaseOutcome:
        """Validate the replies to ``configure_evaluate``'s messages: report, mean and std."""
        parts = [reply_part(r) for r in replies]
        validate(parts, self._evaluation, self.nodes.node_to_client, None)
        return PhaseOutcome.of(self._evaluation)

    # ----------------------------------------------------------------- Flower Strategy API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One training message per sampled node, holding that client's payload only."""
        self.current_round = server_round
        self.learn_node_mapping(grid, server_round)
        chosen = self.train_clients(server_round)
        self._training = FusedRound(RoundReport(sent=chosen))
        self.privacy.dispatched(server_round, self.phase(server_round))  # local DP's release
        return self._messages(chosen, server_round, MessageType.TRAIN, self.train_payload, config)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, update the state from the valid ones, return mean train metrics."""
        return None, self.aggregate_round(server_round, None, replies).train.metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One evaluation message per sampled node with its personalized payload."""
        self.learn_node_mapping(grid, server_round)
        chosen = self.evaluate_clients(server_round)
        self._evaluation = RoundReport(sent=chosen)
        return self._messages(
            chosen, server_round, MessageType.EVALUATE, self.evaluate_payload, config
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Validate evaluation replies; mean and std of the per-client metrics."""
        return self.aggregate_evaluation(server_round, replies).metrics

    def summary(self) -> None:
        """Log what this strategy is."""
        log.info("%s on %d clients", type(self).__name__, len(self.clients()))

    # ----------------------------------------------------------------- state
    @property
    def releases(self) -> ReleaseLedger | None:
        """The ledger of the DP releases so far (None without DP), which the runner keeps on
        disk before anything that may carry a release goes out."""
        return self.privacy.ledger

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON metadata) of the full strategy state; under DP the metadata holds the
        release ledger (and so the noise source)."""
        meta: dict[str, Any] = {"strategy": type(self).__name__, "method": self.config.method}
        meta.update(self.privacy.state_meta())
        return self.state_tensors(), meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore a state written by ``state_dict``; another method's state is refused (by
        its strategy class, for a checkpoint that does not name its method), as is a DP state
        without a ledger of fresh noise."""
        if "method" in meta:
            found, expected = meta["method"], self.config.method
        else:
            found, expected = meta.get("strategy"), type(self).__name__
        if found != expected:
            raise ValueError(f"checkpoint holds a {found} state, not {expected}")
        self.privacy.load_state_meta(meta)
        self.load_state_tensors(tensors)

    def _messages(
        self, clients: list[int], server_round: int, kind: str, payload: Payload, config: Any
    ) -> list[Message]:
        """Per-node ``kind`` messages of ``server_round`` for ``clients`` (``messages``)."""
        node_of, phase = self.nodes.nodes_by_client(), self.phase(server_round)
        run_name = self.context.run_name
        return per_node_messages(
            clients, server_round, kind, payload, config, node_of, run_name, phase
        )
