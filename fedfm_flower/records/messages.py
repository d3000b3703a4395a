"""Conversions between torch tensors and Flower records, keyed by parameter name.

Messages carry their tensors packed (``to_message_record``: one ``Array`` per pack,
``packed_arrays``), because Flower transfers every ``Array`` of a message as an object of its
own; records of one ``Array`` per name (``to_array_record``: the client's saved state, and
replies of other clients) are read alike. Replies are never deserialized with pickle: a plain
``Array`` holds ``np.save`` bytes loaded with ``allow_pickle=False``, a pack raw bytes read
with ``np.frombuffer``; shapes and dtypes are checked from the metadata and the packs'
headers before any array is decoded, so an oversized or malformed payload is rejected cheaply.

Every message encodes and decodes the same few shapes, and ``np.save``/``np.load`` spend most
of their time on the ``.npy`` header (``np.load`` parses it with ``ast.literal_eval``). So the
header ``np.save`` wrote for a (dtype, shape) is remembered (``_NpySpec``): later arrays of
that spec are encoded as that header plus their bytes, which is byte for byte what ``np.save``
writes for a C-contiguous array, and a payload that starts with exactly that header and has
exactly the array's size is decoded with ``np.frombuffer``. Anything else (a spec not seen
yet, another header, a size that does not match) goes through ``np.save``/``np.load`` as before.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from fedfm_flower.records.packed_arrays import (
    MalformedPack,
    PackedEntry,
    header_of,
    is_packed,
    pack,
    unpack,
)

_NUMPY_STYPE = "numpy.ndarray"  # Flower's SType.NUMPY: np.save bytes
PACK_KEY = "fedfm.packed."  # a message record's packs: fedfm.packed.0, .1, ...
_MAX_SPECS = 4096  # (dtype, shape) pairs remembered; a model has a bounded set of shapes


@dataclass(frozen=True)
class _NpySpec:
    """What ``np.save`` wrote for one (dtype, shape): the header, and the array's size."""

    dtype: np.dtype
    name: str  # str(dtype), Flower's ``Array.dtype``
    shape: tuple[int, ...]
    header: bytes
    nbytes: int


# Looked up when encoding (by dtype and shape) and when decoding (by Array.dtype and shape).
_BY_DTYPE: dict[tuple[np.dtype, tuple[int, ...]], _NpySpec] = {}
_BY_NAME: dict[tuple[str, tuple[int, ...]], _NpySpec] = {}


class InvalidRecord(ValueError):
    """An ArrayRecord that breaks the expected spec; the message says how."""


def encode_array(array: np.ndarray) -> Array:
    """A Flower ``Array`` holding exactly the bytes ``Array(array)`` (``np.save``) would hold."""
    spec = _BY_DTYPE.get((array.dtype, array.shape))
    if spec is None or not array.flags.c_contiguous:
        encoded = Array(array)
        _remember(array, encoded)
        return encoded
    return Array(
        dtype=spec.name, shape=spec.shape, stype=_NUMPY_STYPE, data=spec.header + array.tobytes()
    )


def _remember(array: np.ndarray, encoded: Array) -> None:
    """Keep the header ``np.save`` wrote for ``array`` when the rest is the array's C bytes
    (plain native dtypes only: bool, integers, floats, complex)."""
    if len(_BY_DTYPE) >= _MAX_SPECS or array.dtype.isbuiltin != 1 or not array.flags.c_contiguous:
        return
    size = len(encoded.data) - array.nbytes
    if size <= 0 or encoded.data[size:] != array.tobytes():
        return
    spec = _NpySpec(array.dtype, encoded.dtype, encoded.shape, encoded.data[:size], array.nbytes)
    _BY_DTYPE[(array.dtype, array.shape)] = spec
    _BY_NAME[(spec.name, spec.shape)] = spec


def decode_array(array: Array) -> np.ndarray:
    """A writable copy of the array an ``Array`` holds (what ``np.array(array.numpy())`` gives)."""
    spec = _BY_NAME.get((array.dtype, tuple(array.shape)))
    data = array.data
    if (
        spec is not None
        and array.stype == _NUMPY_STYPE
        and len(data) == len(spec.header) + spec.nbytes
        and data.startswith(spec.header)
    ):
        flat = np.frombuffer(data, dtype=spec.dtype, offset=len(spec.header))
        return flat.reshape(spec.shape).copy()
    return np.array(array.numpy())


def to_array_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors as an ArrayRecord of one ``Array`` each (copied to CPU, order kept)."""
    record = ArrayRecord()
    for name, tensor in tensors.items():
        record[name] = encode_array(_numpy(tensor))
    return record


def to_message_record(
    tensors: Mapping[str, torch.Tensor], groups: Iterable[Collection[str]] = ()
) -> ArrayRecord:
    """Named tensors as a message's ArrayRecord: packed (``packed_arrays``), each of ``groups``
    in a pack of its own and the rest in one more, so a group sent alike to every client
    travels as the same object, which Flower stores once."""
    left = dict(tensors)
    packs: list[dict[str, np.ndarray]] = []
    for group in groups:
        chosen = {name: _numpy(left.pop(name)) for name in list(left) if name in group}
        if chosen:
            packs.append(chosen)
    if left:
        packs.append({name: _numpy(tensor) for name, tensor in left.items()})
    return ArrayRecord({f"{PACK_KEY}{i}": pack(arrays) for i, arrays in enumerate(packs)})


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().contiguous().numpy()


def numpy_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The named arrays an ArrayRecord holds, plain or packed (writable copies); InvalidRecord
    when a pack is malformed or a name appears twice."""
    return _decoded(_parts(record))


def _decoded(parts: list[tuple[str, Array, list[PackedEntry] | None]]) -> dict[str, np.ndarray]:
    """The named arrays of a record's checked parts; InvalidRecord when a name appears twice."""
    out: dict[str, np.ndarray] = {}
    for key, array, entries in parts:
        arrays = {key: decode_array(array)} if entries is None else unpack(array, entries)
        for name, values in arrays.items():
            if name in out:
                raise InvalidRecord(f"'{name}' appears twice")
            out[name] = values
    return out


def _parts(record: ArrayRecord) -> list[tuple[str, Array, list[PackedEntry] | None]]:
    """Each (key, Array, the pack's checked entries or None for a plain Array) of a record;
    InvalidRecord naming the pack whose header breaks its bytes."""
    parts = []
    for key, array in record.items():
        entries = None
        if is_packed(array):
            try:
                entries = header_of(array)
            except MalformedPack as err:
                raise InvalidRecord(f"pack '{key}': {err}") from None
        parts.append((key, array, entries))
    return parts


def record_names(record: ArrayRecord) -> list[str]:
    """The tensor names an ArrayRecord holds, plain or packed, nothing decoded."""
    return list(_declared(_parts(record)))


def from_array_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The named CPU tensors an ArrayRecord holds, plain or packed."""
    return {name: torch.from_numpy(values) for name, values in numpy_arrays(record).items()}


def record_dict_nbytes(content: RecordDict) -> int:
    """Bytes of array payload (plus keys) in every ArrayRecord of a RecordDict."""
    return sum(record.count_bytes() for record in content.array_records.values())


def tensor_spec(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, numpy dtype string) of tensors, the contract a reply must meet."""
    return {
        name: (tuple(t.shape), str(t.detach().cpu().numpy().dtype)) for name, t in tensors.items()
    }


def _declared(
    parts: list[tuple[str, Array, list[PackedEntry] | None]],
) -> dict[str, tuple[tuple[int, ...], str, int]]:
    """Name -> (shape, dtype, payload bytes) as a record's metadata and pack headers declare
    them, nothing decoded; InvalidRecord when a name appears twice."""
    declared: dict[str, tuple[tuple[int, ...], str, int]] = {}
    for key, array, entries in parts:
        if entries is not None:
            items = [(e.name, (e.shape, str(e.dtype), e.nbytes)) for e in entries]
        else:
            items = [(key, (tuple(array.shape), str(array.dtype), len(array.data)))]
        for name, meta in items:
            if name in declared:
                raise InvalidRecord(f"'{name}' appears twice")
            declared[name] = meta
    return declared


def decode_checked(
    record: ArrayRecord | None,
    spec: Mapping[str, tuple[tuple[int, ...], str]],
    required: set[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Decode ``record`` once after checking keys, shapes, dtypes and sizes against ``spec``.

    Every key of ``spec`` must be present unless ``required`` names the ones that must; keys
    outside ``spec`` never may. Raises ``InvalidRecord`` naming the first problem (also NaN/Inf
    in the decoded values, and bytes that decode to another shape or dtype than the array's
    metadata declares).
    """
    if record is None:
        raise InvalidRecord("no arrays record")
    parts = _parts(record)  # each pack's header read and checked once
    declared = _declared(parts)
    missing = sorted((set(spec) if required is None else set(required)) - set(declared))
    extra = sorted(set(declared) - set(spec))
    if missing:
        raise InvalidRecord(f"missing keys {missing[:3]}{'...' if len(missing) > 3 else ''}")
    if extra:
        raise InvalidRecord(f"unexpected keys {extra[:3]}{'...' if len(extra) > 3 else ''}")
    for name, (shape, dtype) in spec.items():
        if name not in declared:
            continue
        got_shape, got_dtype, payload = declared[name]
        if got_shape != tuple(shape):
            raise InvalidRecord(f"'{name}' has shape {got_shape}, expected {tuple(shape)}")
        if got_dtype != dtype:
            raise InvalidRecord(f"'{name}' has dtype {got_dtype}, expected {dtype}")
        expected_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if payload > expected_bytes + 1024:
            raise InvalidRecord(f"'{name}' payload is {payload} bytes, expected ~{expected_bytes}")
    try:
        tensors = {name: torch.from_numpy(v) for name, v in _decoded(parts).items()}
    except Exception as err:  # noqa: BLE001 - any decoding failure rejects the reply
        raise InvalidRecord(f"cannot be decoded: {err}") from err
    for name, tensor in tensors.items():
        shape, dtype = spec[name]
        decoded = (tuple(tensor.shape), str(tensor.numpy().dtype))
        if decoded != (tuple(shape), dtype):
            raise InvalidRecord(
                f"'{name}' holds an array of shape {decoded[0]} and dtype {decoded[1]}, not the "
                f"{tuple(shape)} {dtype} it declares"
            )
        if not torch.isfinite(tensor).all():
            raise InvalidRecord(f"'{name}' contains NaN or Inf")
    return tensors
