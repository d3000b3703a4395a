"""Property-based tests: generated replies against every registered strategy's validation.

Every method of the registry (``fedfm_flower.methods.registry.METHODS``) builds its strategy once
per module, over a few small tensors of its modality's parameter groups (an image model's adapter,
prompts, prefixes, ViT and head; a language model's global and local LoRA; a multi-modal
model's encoders and decoder, each owned by the clients that hold its modality or task), with
four identified clients of which three are sampled. Each generated round answers the
strategy's training messages, in a drawn order, with replies that are valid or wrong in one
drawn way: a Flower error, a ClientApp error, no metrics, a wrong or odd client id, a bad
example count, a NaN, infinite, list-valued or out-of-range metric, no arrays, missing or
extra names, another shape or dtype (float16, bfloat16, ints, bool, complex, made-up names),
an oversized, truncated or undecodable payload, a payload whose bytes hold another shape than
it declares, a torn pack, NaN or Inf values; the valid replies and those wrong outside their
arrays' encoding come as one ``Array`` per name or packed, as drawn; plus replies from unknown
nodes, from identified clients that were not sent a message, a client's second reply, and the
SuperLink's "unanswered" errors.
Valid replies carry drawn values, example counts (0 to 2**63 - 1) and extra metrics.

The properties, for every strategy:

1. ``aggregate_round`` never raises;
2. every wrong reply is rejected, keyed by its client (or its node when the node is not
   identified), with a reason that names what was wrong;
3. exactly the valid replies are accepted (an unanswered message leaves its client missing);
4. when no reply is valid, ``state_dict()`` is bit for bit what it was (under central DP the
   noised mean of no update is released instead, and its release counted).

pFedPG's and pFedSeq's rounds cost ~30x and ~4x the others' (pFedPG's prompt generator runs
for every client and message, pFedSeq's sequential learner steps on every accepted round), so
they get fewer examples (``SLOW``). The evaluation phase (``aggregate_evaluation``)
and the identity query (``NodeDirectory``) get the metric and sender faults.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.halves import strategy_class
from fedfm_flower.methods.registry import METHODS
from fedfm_flower.models import TrainableTensors
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import decode_array, encode_array
from fedfm_flower.records.packed_arrays import pack
from server_apps.inprocess import InProcessGrid, identity_app
from strategies.parts.context import RunContext
from strategies.parts.exchange import Exchanged
from strategies.parts.nodes import NodeDirectory
from strategies.parts.replies import UNDELIVERED_CODES
from tests.properties import examples
from tests.run_configs import method_base

NUM_CLIENTS = 4
FRACTION_TRAIN = 0.75  # three of the four clients are sent a message; one is not
SLOW = frozenset({"pfedpg", "pfedseq"})

# Small tensors of each modality's parameter groups: name -> (shape, group).
TENSORS: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {
    "image": {
        "backbone.blocks.0.attn.qkv.lora_A.default.weight": ((2, 4), "adapter"),
        "backbone.blocks.0.attn.qkv.lora_B.default.weight": ((6, 2), "adapter"),
        "backbone.blocks.1.attn.qkv.lora_A.default.weight": ((2, 4), "adapter"),
        "prompt.prompts": ((1, 2, 4), "prompt"),
        "blocks.0.attn.prefix.down.weight": ((3, 4), "prefix"),
        "vit.blocks.0.mlp.fc1.weight": ((4, 4), "vit.mlp"),
        "head.weight": ((3, 4), "head"),
        "head.bias": ((3,), "head"),
    },
    "text": {
        "model.layers.0.self_attn.q_proj.lora_A.global.weight": ((2, 4), "adapter.global"),
        "model.layers.0.self_attn.q_proj.lora_B.global.weight": ((4, 2), "adapter.global"),
        "model.layers.0.self_attn.q_proj.lora_A.local.weight": ((2, 4), "adapter.local"),
    },
    "multimodal": {
        "encoder.image.w": ((3, 2), "encoder.image"),
        "encoder.text.w": ((2,), "encoder.text"),
        "decoder.vqa.w": ((2, 2), "decoder.vqa"),
        "head.w": ((2,), "head"),
    },
}
# Who uses a multi-modal model's components, and what each client holds (client 3: all).
USERS = {
    "encoder.image": frozenset({"image"}),
    "encoder.text": frozenset({"text"}),
    "decoder.vqa": frozenset({"vqa"}),
}
HOLDINGS = {0: ("image", "vqa"), 1: ("text",), 2: ("image", "text", "vqa"), 3: ()}


def initial_tensors(modality: str) -> TrainableTensors:
    """The modality's small tensors, seeded."""
    generator = torch.Generator().manual_seed(0)
    spec = TENSORS[modality]
    return TrainableTensors(
        {name: torch.randn(shape, generator=generator) for name, (shape, _) in spec.items()},
        {name: group for name, (_, group) in spec.items()},
        USERS if modality == "multimodal" else {},
    )


def state_digest(strategy: Any) -> str:
    """SHA-256 of the strategy's state tensors (names, dtypes, shapes, bytes) and metadata."""
    tensors, meta = strategy.state_dict()
    digest = hashlib.sha256(repr(sorted(meta.items())).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class Case:
    """A method's strategy with its nodes identified, its grid and its initial state."""

    strategy: Any
    grid: InProcessGrid
    snapshot: tuple[dict[str, torch.Tensor], dict[str, Any]]
    nodes: dict[int, int] = field(default_factory=dict)  # client id -> node id


# Cases beside the registry's methods: FedAvg under central DP (a noised average, a release
# ledger in the state), local DP (a release per dispatch) and SecAgg+ (replies hold no arrays).
VARIANTS: dict[str, dict[str, Any]] = {
    "fedavg+dp-central": {"method": "fedavg", "dp": "central"},
    "fedavg+dp-local": {"method": "fedavg", "dp": "local"},
    "fedavg+secagg": {"method": "fedavg", "secagg": True},
}

# PerAda's server distils on a model built from the run config, which the small tensors above
# do not fit: distillation is off here (the replies reach the same FedAvg average it starts
# from; tests/test_perada.py distils from accepted replies).
METHOD_KEYS: dict[str, dict[str, Any]] = {"perada": {"perada-kd-steps": 0}}


@functools.cache
def case(name: str) -> Case:
    """The strategy of method (or variant) ``name``, built once per test session."""
    method = VARIANTS.get(name, {"method": name})["method"]
    spec = METHODS[method]
    modality = spec.modalities[0] if spec.modalities else "image"
    run_config = {
        **method_base(method),
        **METHOD_KEYS.get(method, {}),
        **VARIANTS.get(name, {}),
        "num-clients": NUM_CLIENTS,
        "fraction-train": FRACTION_TRAIN,
    }
    config = ExperimentConfig.from_run_config(run_config)
    context = RunContext(run_name="properties", client_holdings=HOLDINGS)
    strategy = strategy_class(method)(config, initial_tensors(modality), context)
    grid = InProcessGrid(
        identity_app(),
        config.to_run_config(),
        [{"client-id": c} for c in range(NUM_CLIENTS)],
    )
    strategy.learn_node_mapping(grid, 1)
    assert strategy.clients() == list(range(NUM_CLIENTS))
    snapshot = strategy.state_dict()
    return Case(strategy, grid, snapshot, strategy.nodes.nodes_by_client())


@pytest.fixture(autouse=True, scope="module")
def quiet_rejections() -> Iterator[None]:
    """No log record per rejected reply (thousands): the reports are what is checked."""
    logger = logging.getLogger("strategies")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


# ------------------------------------------------------------------------------ values

FINITE_FLOATS = st.floats(allow_nan=False, allow_infinity=False)
NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])
NUMBER_LISTS = st.one_of(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
    st.lists(st.floats(), max_size=3),
)
VALID_COUNTS = st.one_of(
    st.integers(0, 10**6), st.sampled_from([0, 1, 2**31, 2**53 + 1, 2**63 - 1])
)
# Metric names a client may add beside the protocol's (any text but those).
METRIC_NAMES = st.text(min_size=1, max_size=12).filter(
    lambda name: name not in (P.CLIENT_ID, P.NUM_EXAMPLES)
)
VALID_METRICS = st.dictionaries(
    METRIC_NAMES,
    st.one_of(FINITE_FLOATS, st.integers(-(10**30), 10**30)),
    max_size=3,
)
OTHER_DTYPES = (
    "float16",
    "float64",
    "int8",
    "int32",
    "int64",
    "uint8",
    "bool",
    "complex64",
)
MADE_UP_DTYPES = st.one_of(
    st.sampled_from(["bfloat16", "float8_e4m3fn", "object", "<f4", "float"]),
    st.text(max_size=10),
)
SHAPES = st.lists(st.integers(0, 5), max_size=3).map(tuple)


def values(seed: int, scale: float, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Seeded normal values times ``scale``, as ``dtype``."""
    rng = np.random.default_rng(seed)
    return np.asarray(rng.standard_normal(shape) * scale).astype(dtype)


# ------------------------------------------------------------------------------ faults


@dataclass
class Planned:
    """A generated reply and what validation must make of it."""

    reply: Message
    key: str | None  # the report key of its sender (client id, or "node N"); None: none
    outcome: str  # "accepted", "rejected" or "missing"
    reason: str = ""  # for "rejected": what the reason must contain (lower case)
    client: int | None = None  # the client it counts for (accepted or missing)


Draw = Callable[[st.SearchStrategy[Any]], Any]


def content(
    draw: Draw, client_id: int, spec: dict[str, tuple[tuple[int, ...], str]]
) -> tuple[dict[str, Array], dict[str, Any]]:
    """A valid reply's arrays (Flower Arrays, by name) and metrics for ``client_id``."""
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1.0, 0.0, 1e-3, 1e3, 1e6]))
    arrays = {
        name: encode_array(values(seed + i, scale, shape, dtype))
        for i, (name, (shape, dtype)) in enumerate(sorted(spec.items()))
    }
    metrics = {**draw(VALID_METRICS), P.CLIENT_ID: client_id, P.NUM_EXAMPLES: draw(VALID_COUNTS)}
    return arrays, metrics


def message(reply_to: Message, arrays: dict[str, Array] | None, metrics: Any) -> Message:
    """A reply to ``reply_to`` holding ``arrays`` (None: no arrays record) and ``metrics``
    (None: no metrics record)."""
    records: dict[str, Any] = {}
    if arrays is not None:
        record = ArrayRecord()
        for name, array in arrays.items():
            record[name] = array
        records[P.ARRAYS] = record
    if metrics is not None:
        records[P.METRICS] = MetricRecord(metrics)
    return Message(RecordDict(records), reply_to=reply_to)


def from_node(reply: Message, node_id: int) -> Message:
    """``reply`` as if ``node_id`` had sent it."""
    reply.metadata.__dict__["_src_node_id"] = node_id
    return reply


# Faults that need names in the reply spec, and those that need a float tensor.
ARRAY_FAULTS = (
    "missing",
    "shape",
    "dtype",
    "oversized",
    "truncated",
    "stype",
    "lying",
    "torn-pack",
)
VALUE_FAULTS = ("values",)
ANY_FAULTS = (
    "error",
    "undelivered",
    "train-error",
    "no-metrics",
    "client-id",
    "num-examples",
    "metric-nan",
    "metric-list",
    "metric-range",
    "no-arrays",
    "extra",
)


# Kinds whose reply may carry its arrays packed: the fault survives packing.
PACKABLE = ("valid", *ANY_FAULTS)


def packed(arrays: dict[str, Array]) -> dict[str, Array]:
    """``arrays`` in one pack, as ``records.to_message_record`` lays a reply out."""
    return {"fedfm.packed.0": pack({name: decode_array(a) for name, a in arrays.items()})}


def faults_for(spec: dict[str, tuple[tuple[int, ...], str]], required: set[str]) -> list[str]:
    """The fault kinds a reply with ``spec`` can have ("valid" first: Hypothesis shrinks to it)."""
    kinds = ["valid", *ANY_FAULTS]
    if spec:
        kinds += [k for k in ARRAY_FAULTS if k != "missing" or required]
    if any(np.dtype(dtype).kind == "f" for _, dtype in spec.values()):
        kinds += VALUE_FAULTS
    return kinds


def faulty(
    draw: Draw,
    kind: str,
    reply_to: Message,
    client_id: int,
    spec: dict[str, tuple[tuple[int, ...], str]],
    required: set[str],
) -> Planned:
    """A reply to ``reply_to`` from ``client_id`` with the fault ``kind`` ("valid": none)."""
    key = str(client_id)
    arrays, metrics = content(draw, client_id, spec)
    if kind in PACKABLE and draw(st.booleans()):  # as our clients send them, in one pack
        arrays = packed(arrays)

    def rejected(reply: Message, reason: str) -> Planned:
        return Planned(reply, key, "rejected", reason.lower())

    if kind == "valid":
        return Planned(message(reply_to, arrays, metrics), key, "accepted", client=client_id)
    if kind in ("error", "undelivered"):
        codes = st.sampled_from(sorted(UNDELIVERED_CODES))
        if kind == "error":
            codes = st.integers(-(2**31), 2**31 - 1).filter(lambda c: c not in UNDELIVERED_CODES)
        error = Error(code=draw(codes), reason=draw(st.text(max_size=200)))
        reply = Message(error, reply_to=reply_to)
        if kind == "undelivered":  # made up by the SuperLink, or relayed from the node
            if draw(st.booleans()):
                from_node(reply, SUPERLINK_NODE_ID)
            return Planned(reply, None, "missing", client=client_id)
        return rejected(reply, "client error")
    if kind == "train-error":
        reply = message(reply_to, arrays, metrics)
        reply.content[P.CONFIG] = ConfigRecord({P.TRAIN_ERROR: draw(st.text(max_size=200))})
        return rejected(reply, "client error")
    if kind == "no-metrics":
        return rejected(message(reply_to, arrays, None), "no metrics record")
    if kind == "client-id":
        odd = st.one_of(
            st.integers(-(2**63), 2**63 - 1).filter(lambda c: c != client_id),
            st.floats(),
            NUMBER_LISTS,
            st.just(float(client_id)),
            st.none(),
        )
        value = draw(odd)
        if value is None:
            del metrics[P.CLIENT_ID]
        else:
            metrics[P.CLIENT_ID] = value
        return rejected(message(reply_to, arrays, metrics), "client-id")
    if kind == "num-examples":
        bad = st.one_of(
            st.integers(max_value=-1), st.floats(), NUMBER_LISTS, st.integers(2**64, 10**400)
        )
        value = draw(st.one_of(bad, st.none()))
        if value is None:
            del metrics[P.NUM_EXAMPLES]
        else:
            metrics[P.NUM_EXAMPLES] = value
        return rejected(message(reply_to, arrays, metrics), "num-examples")
    if kind in ("metric-nan", "metric-list", "metric-range"):
        name = draw(METRIC_NAMES)
        if kind == "metric-nan":
            metrics[name], reason = draw(NON_FINITE), "nan or inf"
        elif kind == "metric-list":
            metrics[name], reason = draw(NUMBER_LISTS), "not a number"
        else:
            metrics[name], reason = draw(st.integers(10**309, 10**400)), "not a finite number"
        if draw(st.booleans()):
            metrics[name] = -metrics[name] if kind == "metric-range" else metrics[name]
        return rejected(message(reply_to, arrays, metrics), reason)
    if kind == "no-arrays":
        return rejected(message(reply_to, None, metrics), "no arrays record")
    if kind == "extra":
        name = draw(st.text(min_size=1, max_size=30).filter(lambda n: n not in {*spec, *arrays}))
        arrays[name] = encode_array(np.zeros(draw(SHAPES), dtype="float32"))
        return rejected(message(reply_to, arrays, metrics), "unexpected keys")
    if kind == "missing":
        gone = draw(st.lists(st.sampled_from(sorted(required)), min_size=1, unique=True))
        for name in gone:
            del arrays[name]
        return rejected(message(reply_to, arrays, metrics), "missing keys")
    name = draw(st.sampled_from(sorted(spec)))
    shape, dtype = spec[name]
    seed = draw(st.integers(0, 2**32 - 1))
    good = values(seed, 1.0, shape, dtype)
    if kind == "shape":
        other = draw(SHAPES.filter(lambda s: s != tuple(shape)))
        arrays[name] = encode_array(values(seed, 1.0, other, dtype))
        return rejected(message(reply_to, arrays, metrics), "has shape")
    if kind == "dtype":
        other = draw(st.one_of(st.sampled_from(OTHER_DTYPES), MADE_UP_DTYPES))
        if other == dtype:
            other = "float16" if dtype != "float16" else "float64"
        if other in OTHER_DTYPES:
            arrays[name] = encode_array(good.astype(other))
        else:  # no numpy dtype (bfloat16, made-up names): the bytes as a client would send
            data = encode_array(good).data
            arrays[name] = Array(dtype=other, shape=tuple(shape), stype="numpy.ndarray", data=data)
        return rejected(message(reply_to, arrays, metrics), "has dtype")
    if kind == "oversized":
        data = encode_array(good).data + bytes(draw(st.integers(1025, 100_000)))
        arrays[name] = Array(dtype=dtype, shape=tuple(shape), stype="numpy.ndarray", data=data)
        return rejected(message(reply_to, arrays, metrics), "payload is")
    if kind == "truncated":
        data = encode_array(good).data
        cut = draw(st.integers(0, len(data) - 1))
        arrays[name] = Array(
            dtype=dtype, shape=tuple(shape), stype="numpy.ndarray", data=data[:cut]
        )
        return rejected(message(reply_to, arrays, metrics), "cannot be decoded")
    if kind == "stype":
        stype = draw(st.text(max_size=20).filter(lambda s: s != "numpy.ndarray"))
        data = encode_array(good).data
        arrays[name] = Array(dtype=dtype, shape=tuple(shape), stype=stype, data=data)
        return rejected(message(reply_to, arrays, metrics), "cannot be decoded")
    if kind == "lying":  # the metadata says the spec's shape and dtype; the bytes hold another
        small = st.lists(st.integers(0, 4), max_size=2).map(tuple)  # within the size check
        other_shape = draw(small.filter(lambda s: s != tuple(shape)))
        other_dtype = draw(st.sampled_from((dtype, *OTHER_DTYPES)))
        data = encode_array(values(seed, 1.0, other_shape, other_dtype)).data
        arrays[name] = Array(dtype=dtype, shape=tuple(shape), stype="numpy.ndarray", data=data)
        return rejected(message(reply_to, arrays, metrics), "declares")
    if kind == "torn-pack":
        whole = pack({n: decode_array(a) for n, a in arrays.items()})
        cut = draw(st.integers(0, len(whole.data) - 1))
        arrays = {"torn": Array(whole.dtype, whole.shape, whole.stype, whole.data[:cut])}
        return rejected(message(reply_to, arrays, metrics), "pack 'torn'")
    assert kind == "values"
    name = draw(st.sampled_from(sorted(n for n, (_, d) in spec.items() if np.dtype(d).kind == "f")))
    shape, dtype = spec[name]
    bad = values(seed, 1.0, shape, dtype)
    if bad.size == 0:  # nothing to spoil: the reply stays valid
        return Planned(message(reply_to, arrays, metrics), key, "accepted", client=client_id)
    flat = bad.reshape(-1)
    where = draw(st.lists(st.integers(0, flat.size - 1), min_size=1, max_size=flat.size))
    for index in where:
        flat[index] = draw(NON_FINITE)
    arrays[name] = encode_array(bad)
    return rejected(message(reply_to, arrays, metrics), "nan or inf")


def under_secagg(strategy: Any) -> bool:
    """Whether the round's training travels under SecAgg+ (a federated round of a run with
    ``secagg``): its replies then hold no tensors."""
    return bool(strategy.config.secagg) and strategy.phase(strategy.current_round) == "train"


def reply_spec(strategy: Any, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """What ``client_id``'s training reply must hold: nothing under SecAgg+ (the update
    travels masked), else the strategy's spec."""
    return {} if under_secagg(strategy) else strategy.reply_spec(client_id)


def round_replies(
    draw: Draw, strategy: Any, messages: list[Message], nodes: dict[int, int]
) -> list[Planned]:
    """Replies to ``messages`` (one each, of a drawn kind), plus drawn extras: unknown nodes,
    clients not sent a message, second replies."""
    planned: list[Planned] = []
    sent: dict[int, Message] = {}
    for reply_to in messages:
        client_id = int(reply_to.content[P.CONFIG][P.CLIENT_ID])
        sent[client_id] = reply_to
        spec = reply_spec(strategy, client_id)
        required = strategy.required_reply_keys(client_id)
        required = set(spec) if required is None else set(required) & set(spec)
        kind = draw(st.sampled_from(faults_for(spec, required)))
        planned.append(faulty(draw, kind, reply_to, client_id, spec, required))
    extras = draw(st.lists(st.sampled_from(["unknown-node", "not-sent", "again"]), max_size=3))
    unsent = [c for c in nodes if c not in sent]
    for extra in extras:
        reply_to = messages[draw(st.integers(0, len(messages) - 1))]
        client_id = int(reply_to.content[P.CONFIG][P.CLIENT_ID])
        arrays, metrics = content(draw, client_id, reply_spec(strategy, client_id))
        if extra == "unknown-node":
            node_id = draw(st.integers(0, 2**63 - 1).filter(lambda n: n not in nodes.values()))
            metrics[P.CLIENT_ID] = draw(st.integers(-(2**63), 2**63 - 1))
            reply = from_node(message(reply_to, arrays, metrics), node_id)
            planned.append(Planned(reply, f"node {node_id}", "rejected", "no known client id"))
        elif extra == "not-sent" and unsent:
            other = draw(st.sampled_from(unsent))
            metrics[P.CLIENT_ID] = other
            reply = from_node(message(reply_to, arrays, metrics), nodes[other])
            planned.append(Planned(reply, str(other), "rejected", "was not sent a message"))
        elif extra == "again":  # a second reply from a client that was sent one message
            planned.append(Planned(message(reply_to, arrays, metrics), str(client_id), "again"))
    # An identified client with two replies (unanswered messages aside): none counts.
    by_client: dict[str, int] = {}
    for plan in planned:
        if plan.key is not None and not plan.key.startswith("node"):
            by_client[plan.key] = by_client.get(plan.key, 0) + 1
    for plan in planned:
        if plan.key is None or plan.key.startswith("node"):
            continue
        if by_client[plan.key] > 1:
            plan.outcome, plan.reason, plan.client = "rejected", "replies from client", None
        elif plan.outcome == "again":  # its other reply went unanswered: this one counts
            plan.outcome, plan.client = "accepted", int(plan.key)
    order = draw(st.permutations(range(len(planned))))
    return [planned[i] for i in order]


def check_report(report: Any, planned: list[Planned]) -> None:
    """Properties 2 and 3 on a phase's report."""
    accepted = {p.client for p in planned if p.outcome == "accepted"}
    assert set(report.accepted) == accepted
    for plan in planned:
        if plan.outcome == "rejected":
            assert plan.key in report.rejected, (plan.key, report.rejected)
            reason = report.rejected[plan.key]
            assert reason.strip(), plan.key
            assert plan.reason in reason.lower(), (plan.reason, reason)
        elif plan.outcome == "missing" and not any(p.key == str(plan.client) for p in planned):
            assert plan.client in report.missing, (plan.client, report.missing)
    for key in report.rejected:
        assert any(p.key == key for p in planned), key  # no one else is named


# ------------------------------------------------------------------------------ training


def check_training_round(method: str, data: st.DataObject) -> None:
    """Properties 1-4 for one generated training round of ``method``'s strategy."""
    c = case(method)
    strategy = c.strategy
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), c.grid))
    planned = round_replies(data.draw, strategy, messages, c.nodes)
    before = state_digest(strategy)
    try:
        replies = [p.reply for p in planned]
        # under SecAgg+ as the exchange hands them over: no tensors, and here no mean
        exchanged = Exchanged(replies, under_secagg=True) if under_secagg(strategy) else replies
        outcome = strategy.aggregate_round(1, None, exchanged)
        check_report(outcome.train.report, planned)
        if not any(p.outcome == "accepted" for p in planned):
            assert outcome.train.metrics is None
            if strategy.privacy.releases_without_replies:  # central DP: the noise alone
                tensors, meta = strategy.state_dict()
                assert meta["privacy"]["releases"] == [1]
                assert outcome.server_metrics["dp-releases"] == 1.0
            else:
                assert state_digest(strategy) == before
    finally:
        strategy.load_state_dict(*c.snapshot)


FAST_METHODS = sorted(m for m in METHODS if m not in SLOW)


@pytest.mark.parametrize("method", FAST_METHODS)
@settings(max_examples=examples(120))
@given(data=st.data())
def test_generated_training_replies_never_crash_or_change_state(
    method: str, data: st.DataObject
) -> None:
    check_training_round(method, data)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@settings(max_examples=examples(100))
@given(data=st.data())
def test_generated_training_replies_under_dp_and_secagg(variant: str, data: st.DataObject) -> None:
    check_training_round(variant, data)


@pytest.mark.parametrize("method", sorted(SLOW))
@settings(max_examples=examples(40))
@given(data=st.data())
def test_generated_training_replies_slow_strategies(method: str, data: st.DataObject) -> None:
    check_training_round(method, data)


# ------------------------------------------------------------------------------ evaluation

# An evaluation reply carries no arrays, so the array faults do not apply to it.
EVALUATION_FAULTS = ["valid", *(k for k in ANY_FAULTS if k not in ("no-arrays", "extra"))]


@settings(max_examples=examples(300))
@given(method=st.sampled_from(FAST_METHODS), data=st.data())
def test_generated_evaluation_replies_never_crash_or_change_state(
    method: str, data: st.DataObject
) -> None:
    """The evaluation phase (``aggregate_evaluation``): the sender and metric faults, with the
    same properties; an evaluation never changes the state."""
    c = case(method)
    strategy = c.strategy
    messages = list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), c.grid))
    planned = []
    for reply_to in messages:
        client_id = int(reply_to.content[P.CONFIG][P.CLIENT_ID])
        kind = data.draw(st.sampled_from(EVALUATION_FAULTS))
        planned.append(faulty(data.draw, kind, reply_to, client_id, {}, set()))
    before = state_digest(strategy)
    order = data.draw(st.permutations(range(len(planned))))
    outcome = strategy.aggregate_evaluation(1, [planned[i].reply for i in order])
    check_report(outcome.report, planned)
    assert state_digest(strategy) == before


# ------------------------------------------------------------------------------ identity


@dataclass
class IdentityGrid:
    """Nodes that answer the identity query with the given replies' contents (None: a Flower
    error)."""

    answers: dict[int, RecordDict | None]

    def __post_init__(self) -> None:
        InProcessGrid(identity_app(), {}, [])  # the server's identity, which messages read

    def get_node_ids(self) -> list[int]:
        return list(self.answers)

    def send_and_receive(self, messages: list[Message], timeout: float | None = None) -> list:
        replies = []
        for query in messages:
            answer = self.answers[query.metadata.dst_node_id]
            if answer is None:
                replies.append(Message(Error(code=0, reason="unreachable"), reply_to=query))
            else:
                replies.append(Message(answer, reply_to=query))
        return replies


ODD_IDS = st.one_of(st.floats(), NUMBER_LISTS, st.just("missing"))


@settings(max_examples=examples(400))
@given(
    answers=st.lists(
        st.tuples(
            st.one_of(st.integers(-5, 5), st.integers(-(2**63), 2**63 - 1), ODD_IDS),
            st.one_of(st.integers(0, 10), st.floats(), NUMBER_LISTS, st.just("missing")),
            st.text(max_size=20),
            st.booleans(),
        ),
        max_size=6,
    )
)
def test_generated_identity_replies_never_crash_the_node_directory(answers: list) -> None:
    """The identity query (``NodeDirectory.learn``): any client id, num-partitions and
    capabilities; a node is mapped only from an integer client id not held by an earlier
    node, and the num-partitions most nodes report as a positive integer is kept (ties: the
    smallest)."""
    contents: dict[int, RecordDict | None] = {}
    for index, (client_id, partitions, capabilities, error) in enumerate(answers):
        metrics = {}
        if client_id != "missing":
            metrics[P.CLIENT_ID] = client_id
        if partitions != "missing":
            metrics[P.NUM_PARTITIONS] = partitions
        facts = ConfigRecord({P.CAPABILITIES: capabilities})
        record = RecordDict({P.METRICS: MetricRecord(metrics), P.CONFIG: facts})
        contents[100 + index] = None if error else record
    directory = NodeDirectory("properties", {})
    directory.learn(IdentityGrid(contents), 1, lambda client: None)
    expected: dict[int, int] = {}
    for index, (client_id, _, _, error) in enumerate(answers):
        if not error and isinstance(client_id, int) and client_id not in expected.values():
            expected[100 + index] = client_id
    assert directory.node_to_client == expected
    claims = [p for _, p, _, e in answers if not e and isinstance(p, int) and p > 0]
    most = max(map(claims.count, claims), default=0)
    assert directory.num_partitions == min([p for p in claims if claims.count(p) == most] or [0])


# ------------------------------------------------------------------------------ records

RECORD_SPEC = {
    "a": ((3, 4), "float32"),
    "b": ((5,), "float16"),
    "c": ((2, 2), "int64"),
    "d": ((0,), "float32"),
}


def declared_or_rejected(record: ArrayRecord) -> None:
    """``records.decode_checked`` on ``record`` raises ``InvalidRecord`` with a reason, or gives
    tensors of exactly ``RECORD_SPEC``'s names, shapes and dtypes, all finite."""
    from fedfm_flower.records.messages import InvalidRecord, decode_checked

    try:
        tensors = decode_checked(record, RECORD_SPEC)
    except InvalidRecord as err:
        assert str(err).strip()
        return
    for key, (shape, dtype) in RECORD_SPEC.items():
        assert tuple(tensors[key].shape) == shape and str(tensors[key].numpy().dtype) == dtype
        assert bool(torch.isfinite(tensors[key]).all())


@settings(max_examples=examples(600))
@given(
    seed=st.integers(0, 2**32 - 1),
    name=st.sampled_from(sorted(RECORD_SPEC)),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), min_size=1, max_size=3),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_damaged_array_bytes_decode_to_the_declared_arrays_or_are_rejected(
    seed: int, name: str, flips: list[tuple[int, int]], cut: int | None
) -> None:
    """``records.decode_checked`` on a record one of whose arrays has bits flipped anywhere
    (its ``.npy`` header included) and is maybe cut: ``InvalidRecord``, or tensors of exactly
    the declared names, shapes and dtypes, all finite (values may differ: a reply's values are
    the client's)."""
    arrays = {n: encode_array(values(seed, 1.0, shape, d)) for n, (shape, d) in RECORD_SPEC.items()}
    data = bytearray(arrays[name].data)
    for offset, bit in flips:
        data[offset % len(data)] ^= 1 << bit
    damaged = bytes(data if cut is None else data[: cut % len(data)])
    arrays[name] = Array(arrays[name].dtype, arrays[name].shape, arrays[name].stype, damaged)
    record = ArrayRecord()
    for key, array in arrays.items():
        record[key] = array
    declared_or_rejected(record)


@settings(max_examples=examples(600))
@given(
    seed=st.integers(0, 2**32 - 1),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), min_size=1, max_size=3),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_damaged_pack_bytes_decode_to_the_declared_arrays_or_are_rejected(
    seed: int, flips: list[tuple[int, int]], cut: int | None
) -> None:
    """``records.decode_checked`` on a pack with bits flipped anywhere (its header included)
    and maybe cut: ``InvalidRecord``, or tensors of exactly the declared names, shapes and
    dtypes, all finite."""
    whole = pack({n: values(seed, 1.0, shape, d) for n, (shape, d) in RECORD_SPEC.items()})
    data = bytearray(whole.data)
    for offset, bit in flips:
        data[offset % len(data)] ^= 1 << bit
    damaged = bytes(data if cut is None else data[: cut % len(data)])
    record = ArrayRecord()
    record["fedfm.packed.0"] = Array(whole.dtype, whole.shape, whole.stype, damaged)
    declared_or_rejected(record)
