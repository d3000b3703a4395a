"""Named arrays packed into one Flower ``Array``: one object on the wire instead of two per array.

Flower (1.41, 1.42) sends a message as a tree of objects, each pulled or pushed by its own
request: the message, its records, every ``Array`` and every 5 MB chunk of one. The offline
default's reply holds 10 small LoRA and head tensors, so a message was about 24 objects and a
client-round at a deployed SuperNode about 100 requests, most of the node's and the SuperLink's
CPU (docs/benchmarks.md). Packed, the same message is about 6 objects.

The packed form of named arrays is one ``Array`` with ``stype`` ``fedfm.packed.v1``, ``dtype``
``uint8`` and ``shape`` ``(len(data),)``; its ``data`` is

    MAGIC (8 bytes) | header length (4 bytes, little endian) | header (JSON, UTF-8) | padding |
    array bytes, each C-ordered and starting at a multiple of 8

and the header is ``[[name, dtype, shape, offset], ...]`` with offsets into ``data``. Only plain
numeric dtypes are allowed (booleans, integers, floats, complex; never ``object``), so decoding
is ``np.frombuffer``, never pickle. ``header_of`` checks the header against the data before
anything is decoded: names unique, offsets in order, each array inside the data, nothing
trailing; a pack that breaks any of these raises ``MalformedPack`` naming what.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array

STYPE = "fedfm.packed.v1"
MAGIC = b"FEDFMPK1"
ALIGN = 8
MAX_HEADER_BYTES = 8 * 2**20  # a header this long would describe ~100k arrays
_LENGTH = struct.Struct("<I")
_KINDS = frozenset("biufc")  # bool, signed, unsigned, float, complex


class MalformedPack(ValueError):
    """A packed ``Array`` whose bytes do not hold what its header says; the message says how."""


@dataclass(frozen=True)
class PackedEntry:
    """Where one named array lies in a pack."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of the array's values."""
        return math.prod(self.shape) * self.dtype.itemsize  # exact: a lying shape cannot wrap


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def is_packed(array: Array) -> bool:
    """Whether ``array`` is a pack of named arrays."""
    return array.stype == STYPE


def pack(arrays: Mapping[str, np.ndarray]) -> Array:
    """One ``Array`` holding ``arrays`` (names, dtypes, shapes and values), order kept."""
    entries = []
    for name, array in arrays.items():
        if array.dtype.kind not in _KINDS or array.dtype.isbuiltin != 1:
            raise ValueError(f"cannot pack '{name}': dtype {array.dtype} is not a plain number")
        entries.append((name, array.dtype.str, list(array.shape)))
    # Offsets depend on the header's length, which depends on the offsets' digits: lay out
    # with a first guess and grow it until the header fits before the first array.
    start = _aligned(len(MAGIC) + _LENGTH.size + 64)
    while True:
        offsets, end = [], start
        for array in arrays.values():
            offsets.append(_aligned(end))
            end = offsets[-1] + array.nbytes
        header = json.dumps(
            [[n, d, s, o] for (n, d, s), o in zip(entries, offsets, strict=True)],
            separators=(",", ":"),
        ).encode()
        if len(MAGIC) + _LENGTH.size + len(header) <= start:
            break
        start = _aligned(len(MAGIC) + _LENGTH.size + len(header))
    if not offsets:
        end = len(MAGIC) + _LENGTH.size + len(header)
    data = bytearray(end)
    data[: len(MAGIC)] = MAGIC
    data[len(MAGIC) : len(MAGIC) + _LENGTH.size] = _LENGTH.pack(len(header))
    data[len(MAGIC) + _LENGTH.size : len(MAGIC) + _LENGTH.size + len(header)] = header
    for array, offset in zip(arrays.values(), offsets, strict=True):
        data[offset : offset + array.nbytes] = np.ascontiguousarray(array).tobytes()
    return Array(dtype="uint8", shape=(len(data),), stype=STYPE, data=bytes(data))


def header_of(array: Array) -> list[PackedEntry]:
    """The entries a pack declares, checked against its data; MalformedPack if they break it."""
    data = array.data
    if array.stype != STYPE:
        raise MalformedPack(f"stype {array.stype!r} is not {STYPE!r}")
    head = len(MAGIC) + _LENGTH.size
    if len(data) < head or data[: len(MAGIC)] != MAGIC:
        raise MalformedPack("does not start with the pack's magic bytes")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    if length > MAX_HEADER_BYTES or head + length > len(data):
        raise MalformedPack(f"header of {length} bytes does not fit in {len(data)} bytes")
    try:
        raw = json.loads(bytes(data[head : head + length]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MalformedPack(f"header is not JSON: {err}") from None
    if not isinstance(raw, list):
        raise MalformedPack("header is not a list of entries")
    entries: list[PackedEntry] = []
    names: set[str] = set()
    end = head + length
    for item in raw:
        entry = _entry(item)
        if entry.name in names:
            raise MalformedPack(f"'{entry.name}' appears twice")
        if entry.offset < end or entry.offset + entry.nbytes > len(data):
            raise MalformedPack(
                f"'{entry.name}' at bytes {entry.offset}..{entry.offset + entry.nbytes} overlaps "
                f"another part or lies outside the {len(data)} bytes"
            )
        names.add(entry.name)
        entries.append(entry)
        end = entry.offset + entry.nbytes
    if end != len(data):
        raise MalformedPack(f"{len(data) - end} bytes follow the last array")
    return entries


def _entry(item: object) -> PackedEntry:
    """One header entry, type-checked."""
    if not (isinstance(item, list) and len(item) == 4):
        raise MalformedPack(f"entry {str(item)[:80]} is not [name, dtype, shape, offset]")
    name, dtype, shape, offset = item
    if not isinstance(name, str) or not isinstance(dtype, str):
        raise MalformedPack(f"entry {str(item)[:80]} has a name or dtype that is not a string")
    if not (isinstance(shape, list) and all(type(d) is int and 0 <= d < 2**40 for d in shape)):
        raise MalformedPack(f"'{name}' has shape {str(shape)[:80]}, not a list of sizes")
    if type(offset) is not int or offset < 0 or len(shape) > 32:
        raise MalformedPack(f"'{name}' has offset {offset!r} or more than 32 dimensions")
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        raise MalformedPack(f"'{name}' has dtype {dtype!r}, not a numpy dtype") from None
    if parsed.kind not in _KINDS or parsed.isbuiltin != 1:
        raise MalformedPack(f"'{name}' has dtype {dtype!r}, not a plain number")
    return PackedEntry(name, parsed, tuple(shape), offset)


def unpack(array: Array, entries: list[PackedEntry] | None = None) -> dict[str, np.ndarray]:
    """Writable copies of the arrays a pack holds (``entries``: its checked header, if read)."""
    entries = header_of(array) if entries is None else entries
    data = array.data
    out = {}
    for entry in entries:
        count = entry.nbytes // entry.dtype.itemsize
        flat = np.frombuffer(data, dtype=entry.dtype, count=count, offset=entry.offset)
        out[entry.name] = flat.reshape(entry.shape).copy()
    return out
