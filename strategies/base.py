"""The shared base of every personalized strategy in fedfm-flower.

A ``PersonalizedStrategy`` is a Flower ``Strategy`` whose state lives in the strategy, keyed by
the clients' *stable* ids (never Flower node ids, which change across runs and restarts):

* **Node-to-client mapping.** Before a round, nodes the strategy has not seen are sent a QUERY
  message; their replies state their ``client-id``. Nodes that left are forgotten; two nodes
  claiming one client id are reported and the newcomer is ignored (until a node leaves).
* **Per-node messages.** ``configure_train``/``configure_evaluate`` build a new ``RecordDict``
  for each node from ``train_payload(client_id, round)``, so a client's personalized tensors go
  to that client only. The ``arrays`` argument of Flower's interface is ignored: the strategy
  owns its state.
* **Reply validation.** A reply with an error, a missing or foreign ``client-id``, missing or
  extra keys, wrong shapes or dtypes, an oversized payload, NaN/Inf or a bad example count is
  dropped with a logged reason before any state changes; the round goes on with the rest.
* **Fused rounds.** ``configure_round(t + 1, t, grid)`` carries round t's evaluation on round
  t + 1's training messages (``evaluate-round`` = t in their config): a client sampled for both
  evaluates, before it trains, the tensors round t's evaluate message would have carried, and
  replies once; a client due the evaluation but not sampled to train gets round t's evaluate
  message in the same phase. ``aggregate_round`` validates the two parts of a fused reply
  apart (``train_report`` of round t + 1, ``evaluate_report`` of round t): a bad training part
  does not drop the evaluation, nor the reverse. This is exact only when round t's evaluation
  payload *is* round t + 1's training payload, as the default ``evaluate_payload`` makes it;
  ``fuses_evaluation()`` says whether a strategy qualifies (``fused_evaluation = False`` or an
  ``evaluate_payload`` of its own opts out, and the runner then evaluates in a phase of its
  own).
* **State.** ``state_dict()`` returns ``(tensors, meta)``: safetensors-ready tensors and
  JSON-ready metadata, restored exactly by ``load_state_dict``.
* **Capabilities.** The identity query also returns what a client holds (its node config's
  ``capabilities``, e.g. ``image,text,vqa``), kept in ``capabilities`` by client id, so a
  strategy can give a component only to the clients that have its modality or task.
* **Post-training phase.** ``post_training_rounds()`` > 0 adds rounds after the last federated
  round (FedDPA-F's local fine-tuning, TAP's distillation). The runner runs and checkpoints them
  like any round; their messages go to every identified client (whatever ``fraction-train``
  is: FedDPA-F fine-tunes every client's local adapter, TAP distils on every client), say
  ``phase = post-training``, and the ClientApp calls the method's ``post_train``.
  ``phase(round)`` tells which phase a round belongs to; ``current_round`` is the round
  being configured.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedfm_flower import protocol as P
from fedfm_flower.config import ExperimentConfig
from fedfm_flower.models import TrainableTensors
from fedfm_flower.records import InvalidRecord, decode_checked, to_array_record
from fedfm_flower.tracebacks import original_exception
from fedfm_flower.training import round_seed

log = logging.getLogger(__name__)

QUERY_TIMEOUT_S = 120.0
# Error replies the SuperLink makes up for a message that no node answered (the node's heartbeat
# stopped, or the message expired): the client is missing, which is not the client's error.
UNDELIVERED_CODES = frozenset(
    {ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE}
)


@dataclass(frozen=True)
class ClientReply:
    """A validated reply: who sent it, its tensors and its metrics."""

    client_id: int
    node_id: int
    arrays: dict[str, torch.Tensor]
    num_examples: int
    metrics: dict[str, float]


@dataclass
class RoundReport:
    """What happened to the messages of one phase of a round (for the results log)."""

    sent: list[int] = field(default_factory=list)
    accepted: dict[int, dict[str, float]] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)  # client id or node -> reason

    @property
    def missing(self) -> list[int]:
        """Clients that were sent a message and neither replied validly nor were rejected."""
        return [c for c in self.sent if c not in self.accepted and str(c) not in self.rejected]


@dataclass(frozen=True)
class ReplyPart:
    """One phase's part of a reply: its sender and either an error or its records.

    A plain reply is one part; a fused training reply is two (``reply_part``,
    ``evaluation_part``), validated against different reports.
    """

    node_id: int
    error_code: int | None = None  # None: no error
    error_reason: str = ""
    metrics: MetricRecord | None = None
    arrays: ArrayRecord | None = None


def _part(reply: Message, error_key: str, metrics_key: str, arrays_key: str = "") -> ReplyPart:
    """One part of ``reply``: its Flower error, the client's ``error_key`` in its config (that
    part raised), or its ``metrics_key`` metrics (and ``arrays_key`` arrays)."""
    node_id = reply.metadata.src_node_id
    if reply.has_error():
        return ReplyPart(node_id, int(reply.error.code), str(reply.error.reason))
    errors = reply.content.config_records.get(P.CONFIG, ConfigRecord())
    if error_key in errors:
        code = int(ErrorCode.CLIENT_APP_RAISED_EXCEPTION)
        return ReplyPart(node_id, code, str(errors[error_key]))
    content = reply.content
    arrays = content.array_records.get(arrays_key) if arrays_key else None
    return ReplyPart(node_id, metrics=content.metric_records.get(metrics_key), arrays=arrays)


def reply_part(reply: Message) -> ReplyPart:
    """A training or evaluate reply as one part; of a fused training reply, the training part
    (``train-error`` in its config: the training raised)."""
    return _part(reply, P.TRAIN_ERROR, P.METRICS, P.ARRAYS)


def evaluation_part(reply: Message) -> ReplyPart:
    """The evaluation carried on a fused training reply (``evaluate-metrics``)."""
    return _part(reply, P.EVALUATE_ERROR, P.EVALUATE_METRICS)


class PersonalizedStrategy(Strategy):
    """Base of the method strategies: mapping, per-node messages, validation, state."""

    # Whether round t's evaluation of a client equals evaluating, before training, on round
    # t + 1's training message; False keeps evaluation in a phase of its own.
    fused_evaluation: ClassVar[bool] = True

    def __init__(self, config: ExperimentConfig, initial: TrainableTensors) -> None:
        self.config = config
        self.run_name = ""
        self.node_to_client: dict[int, int] = {}
        self.capabilities: dict[int, frozenset[str]] = {}  # client id -> what it holds
        self.train_report = RoundReport()
        self.evaluate_report = RoundReport()
        self.num_partitions = 0  # largest num-partitions a node reported (0: none yet)
        self.refused_nodes: set[int] = set()  # answered with a client id this strategy refuses
        self.server_metrics: dict[str, float] = {}  # the strategy's own numbers of the round
        self.current_round = 0  # the round configure_train was last called for
        self.client_tasks: dict[int, str] = {}  # client id -> its task, when the task names them
        self.client_holdings: dict[int, tuple[str, ...]] = {}  # client id -> what it holds
        self.carried: set[int] = set()  # clients whose training message carries an evaluation

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

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> None:
        """Update the strategy state from the validated training replies."""
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

    # ----------------------------------------------------------------- node mapping
    def learn_node_mapping(self, grid: Grid, server_round: int) -> None:
        """Query nodes not seen before for their client id; forget nodes that left."""
        present = set(grid.get_node_ids())
        left = [n for n in self.node_to_client if n not in present]
        for node_id in left:
            log.info("node %s (client %s) left", node_id, self.node_to_client.pop(node_id))
        # A node refused as a duplicate may be the rightful holder once the other one left.
        self.refused_nodes = set() if left else self.refused_nodes & present
        unknown = sorted(present - set(self.node_to_client) - self.refused_nodes)
        if not unknown:
            return
        messages = [
            Message(
                RecordDict({P.CONFIG: ConfigRecord({P.RUN_NAME: self.run_name})}),
                dst_node_id=node_id,
                message_type=MessageType.QUERY,
                group_id=f"query-{server_round}",
            )
            for node_id in unknown
        ]
        for reply in grid.send_and_receive(messages, timeout=QUERY_TIMEOUT_S):
            node_id = reply.metadata.src_node_id
            if reply.has_error():
                log.warning(
                    "node %s did not answer the identity query: %s", node_id, reply.error.reason
                )
                continue
            metrics = reply.content.metric_records.get(P.METRICS, MetricRecord())
            if P.CLIENT_ID not in metrics:
                log.warning("node %s answered the identity query without a client-id", node_id)
                continue
            client_id = int(metrics[P.CLIENT_ID])
            facts = reply.content.config_records.get(P.CONFIG, ConfigRecord())
            declared = str(facts.get(P.CAPABILITIES, ""))
            self.capabilities[client_id] = frozenset(c for c in declared.split(",") if c)
            self.num_partitions = max(self.num_partitions, int(metrics.get(P.NUM_PARTITIONS, 0)))
            refusal = self.refuse_client(client_id)
            if refusal is not None:
                log.warning("node %s is left out: %s", node_id, refusal)
                self.refused_nodes.add(node_id)
                continue
            holder = next((n for n, c in self.node_to_client.items() if c == client_id), None)
            if holder is not None:
                log.warning(
                    "two nodes claim client-id %s (node %s, node %s); ignoring node %s: give "
                    "every SuperNode its own client-id",
                    client_id,
                    holder,
                    node_id,
                    node_id,
                )
                self.refused_nodes.add(node_id)
                continue
            self.node_to_client[node_id] = client_id
        missing = [
            n for n in unknown if n not in self.node_to_client and n not in self.refused_nodes
        ]
        if missing:
            log.warning("nodes without a known client id this round: %s", missing)

    def holdings_of(self, client_id: int) -> tuple[str, ...]:
        """What ``client_id`` holds (its node config's ``capabilities``, else what the task's
        data gives it); empty: every component is its."""
        declared = self.capabilities.get(client_id)
        if declared:
            return tuple(sorted(declared))
        return self.client_holdings.get(client_id, ())

    def clients(self) -> list[int]:
        """Client ids of the nodes currently connected and identified."""
        return sorted(self.node_to_client.values())

    def sample(self, server_round: int, fraction: float, salt: int = 0) -> list[int]:
        """A seeded sample of clients for ``server_round`` (same seed, same sample).

        With ``sample-per-task`` and known ``client_tasks``, ``fraction`` of each task's
        connected clients (at least one each; FedDPA's 40-client setting), else of all.
        """
        clients = self.clients()
        if not clients:
            return []
        rng = random.Random(round_seed(self.config.seed, -1, server_round, salt))
        if self.config.sample_per_task and self.client_tasks:
            groups: dict[str, list[int]] = {}
            for client in clients:
                groups.setdefault(self.client_tasks.get(client, ""), []).append(client)
            chosen = []
            for task in sorted(groups):
                members = groups[task]
                chosen += rng.sample(members, min(len(members), math.ceil(fraction * len(members))))
            return sorted(chosen)
        count = min(
            len(clients), max(self.config.min_train_clients, math.ceil(fraction * len(clients)))
        )
        return sorted(rng.sample(clients, count))

    def train_clients(self, server_round: int) -> list[int]:
        """Who trains in ``server_round``: a ``fraction-train`` sample, everyone in the
        post-training phase."""
        post_training = self.phase(server_round) == "post-training"
        return self.sample(server_round, 1.0 if post_training else self.config.fraction_train)

    # ----------------------------------------------------------------- Flower Strategy API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One training message per sampled node, holding that client's payload only."""
        self.current_round = server_round
        self.learn_node_mapping(grid, server_round)
        chosen = self.train_clients(server_round)
        self.train_report = RoundReport(sent=chosen)
        return self._messages(chosen, server_round, MessageType.TRAIN, self.train_payload, config)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, update the state from the valid ones, return mean train metrics."""
        return None, self._aggregate_training(server_round, [reply_part(r) for r in replies])

    def evaluate_clients(self, server_round: int) -> list[int]:
        """Who evaluates in ``server_round``: a seeded ``fraction-evaluate`` sample."""
        return self.sample(server_round, self.config.fraction_evaluate, salt=1)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One evaluation message per sampled node with its personalized payload."""
        self.learn_node_mapping(grid, server_round)
        chosen = self.evaluate_clients(server_round)
        self.evaluate_report = RoundReport(sent=chosen)
        return self._messages(
            chosen, server_round, MessageType.EVALUATE, self.evaluate_payload, config
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Validate evaluation replies; mean and std of the per-client metrics."""
        self._validate([reply_part(r) for r in replies], self.evaluate_report, check_arrays=False)
        return _mean_metrics(self.evaluate_report.accepted)

    def configure_round(
        self, server_round: int, evaluate_round: int | None, grid: Grid
    ) -> list[Message]:
        """Round ``server_round``'s training messages with ``evaluate_round``'s evaluation fused
        in (none when it is None): the sampled evaluators that train get ``evaluate-round`` in
        their training message's config, the others round ``evaluate_round``'s evaluate
        message."""
        messages = list(self.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))
        self.carried = set()
        self.evaluate_report = RoundReport()
        if evaluate_round is None:
            return messages
        evaluated = self.evaluate_clients(evaluate_round)
        self.evaluate_report = RoundReport(sent=evaluated)
        wanted = set(evaluated)
        for message in messages:
            config = message.content.config_records[P.CONFIG]
            if int(config[P.CLIENT_ID]) in wanted:
                config[P.EVALUATE_ROUND] = evaluate_round
                self.carried.add(int(config[P.CLIENT_ID]))
        alone = [c for c in evaluated if c not in self.carried]
        return messages + self._messages(
            alone, evaluate_round, MessageType.EVALUATE, self.evaluate_payload, ConfigRecord()
        )

    def aggregate_round(
        self, server_round: int, evaluate_round: int | None, replies: Iterable[Message]
    ) -> tuple[MetricRecord | None, MetricRecord | None]:
        """Validate and aggregate the replies to ``configure_round``'s messages: (mean training
        metrics of ``server_round``, mean and std of ``evaluate_round``'s evaluation or None).

        A reply goes by its sender's message: a training reply (its evaluation part too, when
        its message carried one) or an evaluate reply.
        """
        client_of = self.node_to_client
        training: list[ReplyPart] = []
        evaluation: list[ReplyPart] = []
        for reply in replies:
            client = client_of.get(reply.metadata.src_node_id)
            if evaluate_round is not None and client in self.evaluate_report.sent:
                if client not in self.train_report.sent:
                    evaluation.append(reply_part(reply))  # an evaluate-only reply
                    continue
                if client in self.carried:
                    evaluation.append(evaluation_part(reply))
            training.append(reply_part(reply))
        train_metrics = self._aggregate_training(server_round, training)
        if evaluate_round is None:
            return train_metrics, None
        self._validate(evaluation, self.evaluate_report, check_arrays=False)
        return train_metrics, _mean_metrics(self.evaluate_report.accepted)

    def summary(self) -> None:
        """Log what this strategy is."""
        log.info("%s on %d clients", type(self).__name__, len(self.clients()))

    # ----------------------------------------------------------------- state
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON metadata) of the full strategy state."""
        return self.state_tensors(), {"strategy": type(self).__name__}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Restore a state written by ``state_dict``."""
        if meta.get("strategy") != type(self).__name__:
            raise ValueError(
                f"checkpoint holds a {meta.get('strategy')} state, not {type(self).__name__}"
            )
        self.load_state_tensors(tensors)

    # ----------------------------------------------------------------- helpers
    def _messages(self, clients, server_round, message_type, payload, config) -> list[Message]:
        by_client = {c: n for n, c in self.node_to_client.items()}
        messages = []
        for client_id in clients:
            record = ConfigRecord(dict(config))
            record[P.SERVER_ROUND] = server_round
            record[P.RUN_NAME] = self.run_name
            record[P.CLIENT_ID] = client_id
            record[P.PHASE] = self.phase(server_round)
            content = RecordDict(
                {P.ARRAYS: to_array_record(payload(client_id, server_round)), P.CONFIG: record}
            )
            messages.append(
                Message(
                    content,
                    dst_node_id=by_client[client_id],
                    message_type=message_type,
                    group_id=str(server_round),
                )
            )
        return messages

    def _aggregate_training(self, server_round: int, parts: list[ReplyPart]) -> MetricRecord | None:
        """Validate training parts, update the state from the valid ones; mean train metrics."""
        self.server_metrics = {}
        valid = self._validate(parts, self.train_report, check_arrays=True)
        if valid:
            self.aggregate(server_round, valid)
        else:
            log.warning("round %s: no valid training reply; state unchanged", server_round)
        return _mean_metrics(self.train_report.accepted)

    def _validate(
        self, parts: Iterable[ReplyPart], report: RoundReport, *, check_arrays: bool
    ) -> list[ClientReply]:
        valid: list[ClientReply] = []
        for part in parts:
            if part.error_code is not None and part.error_code in UNDELIVERED_CODES:
                log.info("a message went unanswered: %s", part.error_reason)
                continue  # its client stays in report.missing
            node_id = part.node_id
            expected = self.node_to_client.get(node_id)
            key = str(expected) if expected is not None else f"node {node_id}"
            reason = self._reject_reason(part, expected, report)
            arrays: dict[str, torch.Tensor] = {}
            if reason is None and check_arrays:
                try:
                    arrays = decode_checked(
                        part.arrays, self.reply_spec(expected), self.required_reply_keys(expected)
                    )
                except InvalidRecord as err:
                    reason = str(err)
            if reason is not None:
                report.rejected[key] = reason
                log.warning("rejected reply of client %s (node %s): %s", expected, node_id, reason)
                continue
            metrics = dict(part.metrics)
            report.accepted[expected] = {k: float(v) for k, v in metrics.items()}
            valid.append(
                ClientReply(expected, node_id, arrays, int(metrics[P.NUM_EXAMPLES]), metrics)
            )
        for client_id in report.missing:
            log.info("client %s did not reply in time (counted missing)", client_id)
        return sorted(valid, key=lambda r: r.client_id)

    def _reject_reason(
        self, part: ReplyPart, expected: int | None, report: RoundReport
    ) -> str | None:
        """Why the part's sender or metrics are unacceptable, or None."""
        if part.error_code is not None:
            return f"client error: {original_exception(part.error_reason)}"
        if expected is None:
            return "reply from a node with no known client id"
        if expected not in report.sent:
            return f"client {expected} was not sent a message this round"
        metrics = part.metrics
        if metrics is None:
            return "no metrics record"
        if P.CLIENT_ID not in metrics or int(metrics[P.CLIENT_ID]) != expected:
            return (
                f"reply claims client-id {metrics.get(P.CLIENT_ID)} but node belongs to "
                f"client {expected}"
            )
        count = metrics.get(P.NUM_EXAMPLES)
        if not isinstance(count, int) or count < 0:
            return f"bad num-examples {count!r}"
        if any(isinstance(v, float) and not math.isfinite(v) for v in metrics.values()):
            return "metrics contain NaN or Inf"
        return None


def _mean_metrics(per_client: dict[int, dict[str, float]]) -> MetricRecord | None:
    """Mean and population std of every per-client metric (identity metrics excluded)."""
    if not per_client:
        return None
    names = sorted({k for m in per_client.values() for k in m} - P.IDENTITY_METRICS)
    out: dict[str, float] = {}
    for name in names:
        values = [m[name] for m in per_client.values() if name in m]
        out[f"{name}-mean"] = statistics.fmean(values)
        out[f"{name}-std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
    out["num-clients"] = len(per_client)
    return MetricRecord(out)
