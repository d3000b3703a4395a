"""Replies: their parts, and the validation every part passes before any state changes.

A plain reply is one part; a fused training reply is two (``reply_part``, ``evaluation_part``),
validated apart against different reports, so a bad training part does not drop the evaluation,
nor the reverse. A part with an error, a missing or foreign ``client-id``, missing or extra
keys, wrong shapes or dtypes, an oversized payload, NaN/Inf, a metric that is not a finite
number or a bad example count is dropped with a logged reason (in the report's ``rejected``);
so are all the parts of a client that replied more than once in a phase (which one is genuine
cannot be told, and counting both would weigh the client twice). The round goes on with the
rest. An error the SuperLink makes up for a message no node answered (``UNDELIVERED_CODES``)
is not the client's: its client stays missing.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.constant import ErrorCode

from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import InvalidRecord, decode_checked
from fedfm_flower.records.tracebacks import original_exception
from strategies.parts.outcome import RoundReport

log = logging.getLogger(__name__)

# Error replies the SuperLink makes up for a message that no node answered (the node's heartbeat
# stopped, or the message expired): the client is missing, which is not the client's error.
UNDELIVERED_CODES = frozenset(
    {ErrorCode.NODE_UNAVAILABLE, ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE}
)
# The largest example count a reply may state: an int64, what NumPy and torch weigh with.
MAX_EXAMPLES = 2**63 - 1


@dataclass(frozen=True)
class ClientReply:
    """A validated reply: who sent it, its tensors and its metrics."""

    client_id: int
    node_id: int
    arrays: dict[str, torch.Tensor]
    num_examples: int
    metrics: dict[str, float]


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


class ReplySpec(Protocol):
    """What a training reply must hold (a strategy is one: its ``reply_spec`` hooks)."""

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Names, shapes and dtypes a training reply of ``client_id`` must have."""
        ...

    def required_reply_keys(self, client_id: int) -> set[str] | None:
        """Keys of ``reply_spec`` a reply must hold (None: all)."""
        ...


class NoArrays:
    """The spec of a training reply that must hold no tensors (SecAgg+: they travel masked)."""

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """No names."""
        return {}

    def required_reply_keys(self, client_id: int) -> set[str] | None:
        """None required."""
        return set()


NO_ARRAYS = NoArrays()


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


def validate(
    parts: Iterable[ReplyPart],
    report: RoundReport,
    client_of: Mapping[int, int],
    spec: ReplySpec | None,
) -> list[ClientReply]:
    """The valid parts as replies sorted by client id, recorded in ``report`` (accepted, or
    rejected with the reason); ``spec`` checks the arrays (None: evaluation, no arrays)."""
    valid: list[ClientReply] = []
    parts = list(parts)
    replies_of = Counter(client_of.get(p.node_id) for p in parts if not _unanswered(p))
    for part in parts:
        if _unanswered(part):
            log.info("a message went unanswered: %s", part.error_reason)
            continue  # its client stays in report.missing
        node_id = part.node_id
        expected = client_of.get(node_id)
        key = str(expected) if expected is not None else f"node {node_id}"
        if expected is not None and replies_of[expected] > 1:
            count = replies_of[expected]
            reason = f"{count} replies from client {expected} in one phase; none counts"
        else:
            reason = reject_reason(part, expected, report)
        arrays: dict[str, torch.Tensor] = {}
        if reason is None and spec is not None:
            try:
                arrays = decode_checked(
                    part.arrays, spec.reply_spec(expected), spec.required_reply_keys(expected)
                )
            except InvalidRecord as err:
                reason = str(err)
        if reason is not None:
            report.rejected[key] = reason
            log.warning("rejected reply of client %s (node %s): %s", expected, node_id, reason)
            continue
        metrics = dict(part.metrics)
        report.accepted[expected] = {k: float(v) for k, v in metrics.items()}
        valid.append(ClientReply(expected, node_id, arrays, int(metrics[P.NUM_EXAMPLES]), metrics))
    for client_id in report.missing:
        log.info("client %s did not reply in time (counted missing)", client_id)
    return sorted(valid, key=lambda r: r.client_id)


def _unanswered(part: ReplyPart) -> bool:
    """Whether ``part`` is the SuperLink's error for a message no node answered."""
    return part.error_code is not None and part.error_code in UNDELIVERED_CODES


def reject_reason(part: ReplyPart, expected: int | None, report: RoundReport) -> str | None:
    """Why the part's sender or metrics are unacceptable (``expected``: the sender's client
    id, None when unknown), or None."""
    if part.error_code is not None:
        return f"client error: {original_exception(part.error_reason)}"
    if expected is None:
        return "reply from a node with no known client id"
    if expected not in report.sent:
        return f"client {expected} was not sent a message this round"
    metrics = part.metrics
    if metrics is None:
        return "no metrics record"
    claimed = metrics.get(P.CLIENT_ID)
    if not isinstance(claimed, int) or claimed != expected:
        return f"reply claims client-id {claimed!r} but node belongs to client {expected}"
    count = metrics.get(P.NUM_EXAMPLES)
    if not isinstance(count, int) or not 0 <= count <= MAX_EXAMPLES:
        return f"bad num-examples {count!r}"
    if any(isinstance(v, float) and not math.isfinite(v) for v in metrics.values()):
        return "metrics contain NaN or Inf"
    for name, value in metrics.items():
        if isinstance(value, list):
            return f"metric '{name}' is a list, not a number"
        if isinstance(value, int) and not math.isfinite(_as_float(value)):
            return f"metric '{name}' = {value} is not a finite number (beyond a float's range)"
    return None


def _as_float(value: int) -> float:
    """``value`` as a float; infinity where it is beyond a float's range."""
    try:
        return float(value)
    except OverflowError:
        return math.inf
