"""Secure aggregation (SecAgg+, Bell et al. 2020) of the clients' shared updates.

The server learns the weighted mean of the sampled clients' updates (trained - received shared
tensors) and nothing of any one of them. The client side is Flower's own ``secaggplus_mod``,
unchanged, behind ``client_apps.secagg.secagg_mod`` (which hands it the update and the weight);
the server side is here, a driver of the same four stages on Flower's primitives
(``flwr.common.secure_aggregation``), because Flower's ``SecAggPlusWorkflow`` drives a legacy
``Strategy`` through a ``LegacyContext`` and our strategies are message strategies with per-node
payloads:

1. *setup*: each sampled node gets the protocol's parameters and answers two public keys;
2. *share keys*: each node gets its neighbours' keys and answers encrypted shares of its secrets;
3. *collect masked vectors*: each node gets its training message plus the shares meant for it,
   trains, and answers ``[w, w * update]`` quantized and masked (the reply's arrays are emptied);
4. *unmask*: the nodes still there answer the shares that remove the masks: of the survivors'
   private masks, and of the pairwise masks of the nodes that dropped after step 2.

Choices of ours: the clients mask their *updates*, not their trained tensors, so the
``secagg-clipping-range`` that bounds every quantized value can be small and the quantization
fine (the server adds the mean update to its global copy, the same as averaging the trained
tensors); the weight is the client's example count (or 1 where the method weighs clients
equally), divided by ``secagg-max-weight`` as Flower does. Flower's quantization rounds
stochastically with NumPy's global generator, so a SecAgg+ run equals the plain run within the
quantization error, not bit for bit; each client counts the values it had to clip
(``secagg-clipped`` in its training metrics).

Only methods whose server needs the plain average of the same shared tensors from every client
take it (``fedfm_flower.privacy.support.secagg_refusal``); the evaluation messages of a fused
round travel beside step 3 unchanged. A strategy runs it through its exchange part
(``strategies.parts.exchange``, ``SecAggExchange``) and adds the mean with its update part
(``strategies.parts.averaging``, ``SecureMeanUpdate``).

Imports inside functions keep ``flwr.app``, ``flwr.common``, ``flwr.supercore`` and ``torch``
out of this module's start-up.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from fedfm_flower.records import protocol as P

if TYPE_CHECKING:
    import torch
    from flwr.app import Message
    from flwr.serverapp import Grid

    from fedfm_flower.config.experiment import ExperimentConfig

log = logging.getLogger(__name__)

# The SecAgg+ record of a message (Flower's ``RECORD_KEY_CONFIGS``): a literal, so the
# ClientApp's mod can look for it without importing Flower's crypto.
SECAGG_RECORD = "secaggplus_configs"
MODULUS_RANGE = 2**32  # Flower's default; the masks are drawn below it


@dataclass(frozen=True)
class SecAggSettings:
    """The protocol's parameters (the ``secagg-*`` run-config keys)."""

    num_shares: float  # <= 1: a fraction of the sampled nodes; else a count
    threshold: float  # <= 1: a fraction of the shares; else a count
    clipping_range: float
    quantization_range: int
    max_weight: float

    @classmethod
    def of(cls, config: ExperimentConfig) -> SecAggSettings:
        """The settings of ``config``."""
        return cls(
            config.secagg_num_shares,
            config.secagg_threshold,
            config.secagg_clipping_range,
            config.secagg_quantization_range,
            config.secagg_max_weight,
        )

    def shares_and_threshold(self, sampled: int) -> tuple[int, int]:
        """(shares per secret, shares needed to rebuild one) for ``sampled`` nodes, as
        Flower's workflow derives them (an odd count below ``sampled``, at least 2)."""
        if self.num_shares <= 1:
            shares = round(self.num_shares * sampled)
            if shares < sampled and shares % 2 == 0:
                shares += 1
            if shares <= 2:
                shares = sampled
        else:
            shares = min(int(self.num_shares), sampled)
        if self.threshold <= 1:
            threshold = max(round(self.threshold * shares), 2)
        else:
            threshold = int(self.threshold)
        return shares, max(min(threshold, shares), 2)  # 1 would unmask a lone survivor


@dataclass(frozen=True)
class SecureMean:
    """What the server learns from a SecAgg+ round: the weighted mean update of ``nodes``."""

    update: dict[str, torch.Tensor]  # name -> weighted mean of (trained - received), float64
    nodes: frozenset[int]  # the nodes whose masked vectors are in the sum
    total_weight: float  # sum of the quantized weights w / max-weight


@dataclass(frozen=True)
class SecureRound:
    """A SecAgg+ round's replies, its mean update (None: the protocol could not finish) and the
    bytes of the protocol's own records (keys, shares, masked vectors) down and up."""

    replies: list[Message]
    mean: SecureMean | None
    bytes_down: int
    bytes_up: int


@dataclass
class _Protocol:
    """One round's protocol state on the server."""

    settings: SecAggSettings
    round_label: str
    sampled: list[int]
    shares: int = 0
    threshold: int = 0
    active: set[int] = field(default_factory=set)
    keyed: set[int] = field(default_factory=set)  # nodes whose shares went out (step 2)
    neighbours: dict[int, set[int]] = field(default_factory=dict)
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    forwarded: dict[int, tuple[list[int], list[bytes]]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    bytes_down: int = 0
    bytes_up: int = 0

    def count(self, messages: Iterable[Message], up: bool) -> None:
        """Add the SecAgg+ records of ``messages`` to the traffic down or up."""
        size = sum(
            _record_bytes(m.content.config_records[SECAGG_RECORD])
            for m in messages
            if not m.has_error() and SECAGG_RECORD in m.content.config_records
        )
        if up:
            self.bytes_up += size
        else:
            self.bytes_down += size

    def finish(self, replies: list[Message], mean: SecureMean | None) -> SecureRound:
        """The round's outcome."""
        return SecureRound(replies, mean, self.bytes_down, self.bytes_up)


def _record_bytes(record: Mapping[str, Any]) -> int:
    """Bytes of a config record's values: bytes and strings by length, numbers 8 each
    (Flower's ``count_bytes`` fails on an empty list, which a node with no share to send has)."""

    def size(value: Any) -> int:
        return len(value) if isinstance(value, bytes | str) else 8

    return sum(
        sum(size(v) for v in value) if isinstance(value, list) else size(value)
        for value in record.values()
    )


def secure_exchange(
    grid: Grid,
    messages: Sequence[Message],
    settings: SecAggSettings,
    timeout: float | None,
    weighting: str,
) -> SecureRound:
    """Send ``messages`` with their training messages under SecAgg+: the replies (training
    replies without arrays) and the unmasked mean update (None when the protocol could not
    finish: too few nodes, or too few shares to remove the masks; the reason is logged)."""
    from flwr.app import MessageType

    training = [m for m in messages if m.metadata.message_type == MessageType.TRAIN]
    others = [m for m in messages if m.metadata.message_type != MessageType.TRAIN]
    if not training:
        replies = list(grid.send_and_receive(others, timeout=timeout))
        return SecureRound(replies, None, 0, 0)
    names, shapes = _layout(training)
    sampled = [m.metadata.dst_node_id for m in training]
    state = _Protocol(settings, training[0].metadata.group_id, sampled)
    if len(state.sampled) * settings.quantization_range >= MODULUS_RANGE:
        raise ValueError(
            f"SecAgg+: {len(state.sampled)} clients' quantized sum would pass the 2**32 "
            "modulus; lower secagg-quantization-range"
        )
    if len(state.sampled) < 2:
        log.error(
            "SecAgg+ needs 2 or more sampled nodes, not %d: round skipped", len(state.sampled)
        )
        return state.finish(list(grid.send_and_receive(others, timeout=timeout)), None)
    if not (_setup(grid, state, timeout) and _share_keys(grid, state, timeout)):
        return state.finish(list(grid.send_and_receive(others, timeout=timeout)), None)
    replies, masked = _collect(grid, state, training, others, timeout, weighting, len(names))
    if masked is None or not _enough(state):
        return state.finish(replies, None)
    summed = frozenset(state.active)
    vector = _unmask(grid, state, masked, timeout)
    if vector is None:
        return state.finish(replies, None)
    if vector[0].reshape(-1)[0] == 0:
        log.error(
            "SecAgg+ round %s: the clients' weights sum to 0; no aggregate", state.round_label
        )
        return state.finish(replies, None)
    total, mean = _dequantized_mean(vector, state.settings, len(summed))
    import torch

    update = {
        name: torch.from_numpy(np.asarray(array, dtype=np.float64).reshape(shape))
        for name, shape, array in zip(names, shapes, mean, strict=True)
    }
    return state.finish(replies, SecureMean(update, summed, total))


def _layout(training: Sequence[Message]) -> tuple[list[str], list[tuple[int, ...]]]:
    """Names (sorted, the order the clients use) and shapes of the shared tensors; every
    training message must carry the same ones."""
    from fedfm_flower.records.messages import numpy_arrays

    layouts = {
        tuple(
            (name, tuple(array.shape))
            for name, array in sorted(numpy_arrays(m.content.array_records[P.ARRAYS]).items())
        )
        for m in training
    }
    if len(layouts) != 1:
        raise ValueError("SecAgg+ needs the same shared tensors in every training message")
    (layout,) = layouts
    return [name for name, _ in layout], [shape for _, shape in layout]


def _round_message(content: Any, node_id: int, group_id: str) -> Message:
    from flwr.app import Message, MessageType

    return Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN, group_id=group_id)


def _stage_message(stage_values: Mapping[str, Any], node_id: int, group_id: str) -> Message:
    from flwr.app import ConfigRecord, RecordDict

    record = ConfigRecord(dict(stage_values))  # type: ignore[arg-type]
    return _round_message(RecordDict({SECAGG_RECORD: record}), node_id, group_id)


def _answers(
    grid: Grid, state: _Protocol, sent: Iterable[Message], timeout: float | None, stage: str
) -> dict[int, Any]:
    """The stage's replies by node (their SecAgg+ records); nodes that failed leave ``active``."""
    answers: dict[int, Any] = {}
    sent = list(sent)
    state.count(sent, up=False)
    replies = list(grid.send_and_receive(sent, timeout=timeout))
    state.count(replies, up=True)
    for reply in replies:
        node_id = reply.metadata.src_node_id
        if reply.has_error():
            state.failures.append(f"node {node_id} ({stage}): {reply.error.reason}")
            continue
        record = reply.content.config_records.get(SECAGG_RECORD)
        if record is None:
            state.failures.append(f"node {node_id} ({stage}): no {SECAGG_RECORD} record")
            continue
        answers[node_id] = record
    for failure in state.failures:
        log.warning("SecAgg+ round %s: %s", state.round_label, failure)
    state.failures.clear()
    state.active &= set(answers)
    return {n: a for n, a in answers.items() if n in state.active}


def _enough(state: _Protocol) -> bool:
    """Whether every sampled node still has ``threshold`` active neighbours."""
    for node_id in state.sampled:
        if len(state.neighbours[node_id] & state.active) < state.threshold:
            log.error(
                "SecAgg+ round %s: node %s has fewer than %d active neighbours; no aggregate",
                state.round_label,
                node_id,
                state.threshold,
            )
            return False
    return True


def _setup(grid: Grid, state: _Protocol, timeout: float | None) -> bool:
    from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

    settings = state.settings
    state.shares, state.threshold = settings.shares_and_threshold(len(state.sampled))
    state.active = set(state.sampled)
    order = list(state.sampled)
    random.shuffle(order)  # who neighbours whom: unpredictable to the clients
    half = state.shares // 2
    state.neighbours = {
        node_id: {order[(i + offset) % len(order)] for offset in range(-half, half + 1)}
        for i, node_id in enumerate(order)
    }
    values = {
        Key.STAGE: Stage.SETUP,
        Key.SAMPLE_NUMBER: len(state.sampled),
        Key.SHARE_NUMBER: state.shares,
        Key.THRESHOLD: state.threshold,
        Key.CLIPPING_RANGE: float(settings.clipping_range),
        Key.TARGET_RANGE: int(settings.quantization_range),
        Key.MOD_RANGE: MODULUS_RANGE,
        Key.MAX_WEIGHT: float(settings.max_weight),
    }
    sent = [_stage_message(values, n, state.round_label) for n in state.sampled]
    for node_id, record in _answers(grid, state, sent, timeout, "setup").items():
        state.public_keys[node_id] = (
            cast(bytes, record[Key.PUBLIC_KEY_1]),
            cast(bytes, record[Key.PUBLIC_KEY_2]),
        )
    return _enough(state)


def _share_keys(grid: Grid, state: _Protocol, timeout: float | None) -> bool:
    from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

    sent = []
    for node_id in sorted(state.active):
        neighbours = state.neighbours[node_id] & state.active
        values: dict[str, Any] = {str(n): list(state.public_keys[n]) for n in neighbours}
        values[Key.STAGE] = Stage.SHARE_KEYS
        sent.append(_stage_message(values, node_id, state.round_label))
    answers = _answers(grid, state, sent, timeout, "share keys")
    state.forwarded = {n: ([], []) for n in state.active}
    for source, record in answers.items():
        destinations = cast(list[int], record[Key.DESTINATION_LIST])
        ciphertexts = cast(list[bytes], record[Key.CIPHERTEXT_LIST])
        for destination, ciphertext in zip(destinations, ciphertexts, strict=True):
            if destination in state.forwarded:
                state.forwarded[destination][0].append(source)
                state.forwarded[destination][1].append(ciphertext)
    state.keyed = set(state.active)
    return _enough(state)


def _collect(
    grid: Grid,
    state: _Protocol,
    training: Sequence[Message],
    others: Sequence[Message],
    timeout: float | None,
    weighting: str,
    num_tensors: int,
) -> tuple[list[Message], list[np.ndarray] | None]:
    """Step 3: the training messages (plus the shares for their node) and the others; the
    replies and the sum of the masked vectors mod the modulus (None: no vector came)."""
    from flwr.app import ConfigRecord
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

    sent = list(others)
    for message in training:
        node_id = message.metadata.dst_node_id
        if node_id not in state.active:
            continue
        sources, ciphertexts = state.forwarded[node_id]
        content = message.content
        content.config_records[SECAGG_RECORD] = ConfigRecord(
            {
                Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                Key.CIPHERTEXT_LIST: ciphertexts,
                Key.SOURCE_LIST: sources,
            }
        )
        content.config_records[P.CONFIG][P.SECAGG_WEIGHTING] = weighting
        sent.append(_round_message(content, node_id, message.metadata.group_id))
    state.count(sent, up=False)
    replies = list(grid.send_and_receive(sent, timeout=timeout))
    state.count(replies, up=True)
    expected_shapes: list[tuple[int, ...]] | None = None
    total: list[np.ndarray] | None = None
    vectors: set[int] = set()
    for reply in replies:
        node_id = reply.metadata.src_node_id
        if node_id not in state.active or reply.has_error():
            if node_id in state.active:
                log.warning(
                    "SecAgg+ round %s: node %s (masked vectors): %s",
                    state.round_label,
                    node_id,
                    reply.error.reason,
                )
            continue
        record = reply.content.config_records.get(SECAGG_RECORD)
        try:
            raw = cast(list[bytes], record[Key.MASKED_PARAMETERS])  # type: ignore[index]
            vector = [bytes_to_ndarray(b).astype(np.int64) for b in raw]
        except Exception as err:  # noqa: BLE001 - a malformed vector drops that node
            log.warning(
                "SecAgg+ round %s: node %s sent no masked vector: %s",
                state.round_label,
                node_id,
                err,
            )
            continue
        shapes = [v.shape for v in vector]
        if len(vector) != num_tensors + 1 or (
            expected_shapes is not None and shapes != expected_shapes
        ):
            log.warning(
                "SecAgg+ round %s: node %s sent a masked vector of another layout",
                state.round_label,
                node_id,
            )
            continue
        expected_shapes = shapes
        total = vector if total is None else [a + b for a, b in zip(total, vector, strict=True)]
        vectors.add(node_id)
    state.active &= vectors
    if total is None:
        log.error("SecAgg+ round %s: no masked vector arrived; no aggregate", state.round_label)
        return replies, None
    return replies, [np.mod(a, MODULUS_RANGE) for a in total]


def _unmask(
    grid: Grid, state: _Protocol, masked: list[np.ndarray], timeout: float | None
) -> list[np.ndarray] | None:
    """Step 4: the shares that remove the masks, and the unmasked sum (None: too few shares)."""
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    summed = set(state.active)
    dropped = state.keyed - summed  # their pairwise masks are in the survivors' vectors
    sent = [
        _stage_message(
            {
                Key.STAGE: Stage.UNMASK,
                Key.ACTIVE_NODE_ID_LIST: sorted(state.neighbours[n] & summed),
                Key.DEAD_NODE_ID_LIST: sorted(state.neighbours[n] & dropped),
            },
            n,
            state.round_label,
        )
        for n in sorted(summed)
    ]
    shares: dict[int, list[bytes]] = {n: [] for n in state.sampled}
    for record in _answers(grid, state, sent, timeout, "unmask").values():
        owners = cast(list[int], record[Key.NODE_ID_LIST])
        for owner, share in zip(owners, cast(list[bytes], record[Key.SHARE_LIST]), strict=True):
            if owner in shares:
                shares[owner].append(share)
    shapes = [a.shape for a in masked]
    vector = [a.astype(np.int64) for a in masked]
    for node_id, node_shares in shares.items():
        if node_id not in summed and node_id not in dropped:
            continue
        if len(node_shares) < state.threshold:
            log.error(
                "SecAgg+ round %s: %d of %d shares for node %s; the masks stay, no aggregate",
                state.round_label,
                len(node_shares),
                state.threshold,
                node_id,
            )
            return None
        secret = combine_shares(node_shares)
        if node_id in summed:  # its private mask
            mask = pseudo_rand_gen(secret, MODULUS_RANGE, shapes)
            vector = [v - m for v, m in zip(vector, mask, strict=True)]
            continue
        for neighbour in state.neighbours[node_id] - {node_id}:  # a dropped node's pairwise masks
            if neighbour not in summed:
                continue
            key = generate_shared_key(
                bytes_to_private_key(secret), bytes_to_public_key(state.public_keys[neighbour][0])
            )
            mask = pseudo_rand_gen(key, MODULUS_RANGE, shapes)
            sign = 1 if node_id > neighbour else -1
            vector = [v + sign * m for v, m in zip(vector, mask, strict=True)]
    return [np.mod(v, MODULUS_RANGE) for v in vector]


def _dequantized_mean(
    vector: list[np.ndarray], settings: SecAggSettings, summed: int
) -> tuple[float, list[np.ndarray]]:
    """(sum of the weights, weighted mean) from the unmasked ``[sum q(w), sum q(w x)]``."""
    from flwr.common.secure_aggregation.quantization import dequantize

    q_total = float(vector[0].reshape(-1)[0])
    values = dequantize(vector[1:], settings.clipping_range, settings.quantization_range)
    offset = -(summed - 1) * settings.clipping_range  # each of the `summed` vectors added +range
    scale = settings.quantization_range / q_total
    return q_total / settings.quantization_range, [(v + offset) * scale for v in values]
