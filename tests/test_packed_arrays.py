"""Packed messages: the format round-trips, every malformed pack is refused by name, a message
is a few objects on the wire, and a pack alike for every client is one object."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedfm_flower.records.messages import (
    InvalidRecord,
    decode_checked,
    from_array_record,
    numpy_arrays,
    record_names,
    tensor_spec,
    to_array_record,
    to_message_record,
)
from fedfm_flower.records.packed_arrays import MAGIC, MalformedPack, header_of, pack, unpack
from strategies.parts.messages import alike, per_node_messages

ARRAYS = {
    "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": np.array([1, -2, 3], dtype=np.int64),
    "empty": np.zeros((0, 5), dtype=np.float16),
    "scalar": np.array(2.5, dtype=np.float64),
    "flags": np.array([True, False, True]),
    "c": np.array([1 + 2j], dtype=np.complex64),
}


def test_a_pack_round_trips_names_order_dtypes_shapes_and_values() -> None:
    packed = pack(ARRAYS)
    assert packed.stype == "fedfm.packed.v1" and packed.shape == (len(packed.data),)
    out = unpack(packed)
    assert list(out) == list(ARRAYS)
    for name, array in ARRAYS.items():
        assert out[name].dtype == array.dtype and out[name].shape == array.shape
        assert np.array_equal(out[name], array)
        assert out[name].flags.writeable
    assert [e.offset % 8 for e in header_of(packed)] == [0] * len(ARRAYS)
    assert unpack(pack({})) == {}


def _forged(entries: list, body: bytes = b"", magic: bytes = MAGIC) -> Array:
    header = json.dumps(entries).encode()
    data = magic + struct.pack("<I", len(header)) + header + body
    return Array(dtype="uint8", shape=(len(data),), stype="fedfm.packed.v1", data=data)


@pytest.mark.parametrize(
    ("array", "reason"),
    [
        (_forged([], magic=b"NOTAPACK"), "magic"),
        (Array(dtype="uint8", shape=(3,), stype="fedfm.packed.v1", data=b"FED"), "magic"),
        (_forged([["x", "<f4", [2], 10**6]], b"\0" * 8), "outside"),
        (_forged([["x", "<f4", [2**39, 2**39], 64]], b"\0" * 64), "outside"),  # 2**80 bytes
        (_forged([["x", "<f4", [2], 0]], b"\0" * 8), "overlaps"),
        (_forged([["x", "object", [1], 64]], b"\0" * 64), "not a plain number"),
        (_forged([["x", "float", [-1], 64]], b"\0" * 64), "not a list of sizes"),
        (_forged([["x", "<f4", [1], 64], ["x", "<f4", [1], 72]], b"\0" * 80), "twice"),
        (_forged([["x", "<f4", [1]]], b""), r"is not \[name, dtype, shape, offset\]"),
        (_forged({"x": 1}, b""), "not a list of entries"),  # type: ignore[arg-type]
        (_forged([["x", "no-such-dtype", [1], 64]], b"\0" * 64), "not a numpy dtype"),
    ],
)
def test_a_malformed_pack_is_refused_with_its_reason(array: Array, reason: str) -> None:
    with pytest.raises(MalformedPack, match=reason):
        header_of(array)
    with pytest.raises(InvalidRecord, match=reason):
        numpy_arrays(ArrayRecord({"p": array}))


def test_bytes_beyond_the_last_array_and_a_lying_header_length_are_refused() -> None:
    whole = pack({"x": np.ones(2, np.float32)})
    longer = Array(whole.dtype, whole.shape, whole.stype, whole.data + b"\0")
    with pytest.raises(MalformedPack, match="follow the last array"):
        header_of(longer)
    lying = bytearray(whole.data)
    lying[8:12] = struct.pack("<I", 2**31)
    with pytest.raises(MalformedPack, match="does not fit"):
        header_of(Array(whole.dtype, whole.shape, whole.stype, bytes(lying)))
    not_json = bytearray(whole.data)
    not_json[12] = 0xFF
    with pytest.raises(MalformedPack, match="not JSON"):
        header_of(Array(whole.dtype, whole.shape, whole.stype, bytes(not_json)))


def test_decode_checked_reads_packs_against_the_spec_and_names_what_is_wrong() -> None:
    tensors = {"w": torch.randn(3, 2), "b": torch.zeros(2)}
    spec = tensor_spec(tensors)
    decoded = decode_checked(to_message_record(tensors), spec)
    assert all(torch.equal(decoded[n], tensors[n]) for n in tensors)
    wrong = to_message_record({"w": torch.randn(2, 3), "b": torch.zeros(2)})
    with pytest.raises(InvalidRecord, match=r"'w' has shape \(2, 3\), expected \(3, 2\)"):
        decode_checked(wrong, spec)
    with pytest.raises(InvalidRecord, match="'w' has dtype float64, expected float32"):
        decode_checked(
            to_message_record({"w": torch.randn(3, 2).double(), "b": tensors["b"]}), spec
        )
    with pytest.raises(InvalidRecord, match="NaN or Inf"):
        decode_checked(
            to_message_record({"w": torch.full((3, 2), float("nan")), "b": tensors["b"]}), spec
        )
    twice = to_message_record(tensors)
    twice["w"] = to_array_record({"w": tensors["w"]})["w"]  # plain beside the pack, same name
    with pytest.raises(InvalidRecord, match="'w' appears twice"):
        decode_checked(twice, spec)
    with pytest.raises(InvalidRecord, match="unexpected keys"):
        decode_checked(to_message_record({**tensors, "x": torch.ones(1)}), spec)


def test_plain_and_packed_records_read_the_same() -> None:
    tensors = {"w": torch.randn(3, 2), "i": torch.arange(4)}
    for record in (to_array_record(tensors), to_message_record(tensors)):
        assert record_names(record) == ["w", "i"]
        out = from_array_record(record)
        assert all(torch.equal(out[n], tensors[n]) for n in tensors)
    assert len(to_message_record({})) == 0


@pytest.fixture
def in_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower builds a ``Message`` only inside a task of a run (the ServerApp's)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _objects(record: ArrayRecord) -> int:
    message = Message(
        RecordDict({"arrays": record, "config": ConfigRecord({"x": 1})}),
        dst_node_id=1,
        message_type="train",
    )
    return len(get_all_nested_objects(message))


@pytest.mark.usefixtures("in_a_run")
def test_a_packed_message_is_a_few_objects_where_a_plain_one_is_two_per_tensor() -> None:
    """The cut the packing is for: Flower moves every object of a message by a request."""
    tensors = {f"blocks.{i}.lora_{ab}": torch.randn(4, 8) for i in range(8) for ab in "AB"}
    plain, packed = _objects(to_array_record(tensors)), _objects(to_message_record(tensors))
    assert plain >= 2 * len(tensors) + 3
    assert packed <= 6


@pytest.mark.usefixtures("in_a_run")
def test_a_pack_alike_for_every_client_is_the_same_object() -> None:
    shared = {"body": torch.randn(5, 3)}
    payloads = {c: {**shared, "head": torch.full((2,), float(c))} for c in range(3)}
    assert alike(payloads.values()) == {"body"}
    assert alike([{"x": torch.ones(2)}, {"x": torch.ones(2)}]) == {"x"}
    assert alike([{"x": torch.ones(2)}, {"x": torch.ones(3)}]) == set()
    messages = per_node_messages(
        list(payloads),
        1,
        "train",
        lambda c, _: payloads[c],
        {},
        {c: 100 + c for c in payloads},
        "run",
        "train",
    )
    packs = [m.content["arrays"] for m in messages]
    ids = [{key: array.object_id for key, array in record.items()} for record in packs]
    assert len({i["fedfm.packed.0"] for i in ids}) == 1  # the shared pack: one object
    assert len({i["fedfm.packed.1"] for i in ids}) == 3  # each head: its own
    for client, record in zip(payloads, packs, strict=True):
        out = from_array_record(record)
        assert torch.equal(out["body"], shared["body"]) and float(out["head"][0]) == client
