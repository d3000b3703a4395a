"""Conversions between torch tensors and Flower records, keyed by parameter name.

Replies are never deserialized with pickle: Flower's ``Array`` stores ``np.save`` bytes and
loads them with ``allow_pickle=False``; shapes and dtypes are checked from the metadata before
any array is decoded, so an oversized or malformed payload is rejected cheaply.

Every message encodes and decodes the same few shapes, and ``np.save``/``np.load`` spend most
of their time on the ``.npy`` header (``np.load`` parses it with ``ast.literal_eval``). So the
header ``np.save`` wrote for a (dtype, shape) is remembered (``_NpySpec``): later arrays of
that spec are encoded as that header plus their bytes, which is byte for byte what ``np.save``
writes for a C-contiguous array, and a payload that starts with exactly that header and has
exactly the array's size is decoded with ``np.frombuffer``. Anything else (a spec not seen
yet, another header, a size that does not match) goes through ``np.save``/``np.load`` as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

_NUMPY_STYPE = "numpy.ndarray"  # Flower's SType.NUMPY: np.save bytes
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
    """Pack named tensors into an ArrayRecord (copied to CPU, order kept)."""
    record = ArrayRecord()
    for name, tensor in tensors.items():
        record[name] = encode_array(tensor.detach().cpu().contiguous().numpy())
    return record


def from_array_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """Unpack an ArrayRecord into named CPU tensors."""
    return {name: torch.from_numpy(decode_array(array)) for name, array in record.items()}


def record_dict_nbytes(content: RecordDict) -> int:
    """Bytes of array payload (plus keys) in every ArrayRecord of a RecordDict."""
    return sum(record.count_bytes() for record in content.array_records.values())


def tensor_spec(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, numpy dtype string) of tensors, the contract a reply must meet."""
    return {
        name: (tuple(t.shape), str(t.detach().cpu().numpy().dtype)) for name, t in tensors.items()
    }


class InvalidRecord(ValueError):
    """An ArrayRecord that breaks the expected spec; the message says how."""


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
    missing = sorted((set(spec) if required is None else set(required)) - set(record.keys()))
    extra = sorted(set(record.keys()) - set(spec))
    if missing:
        raise InvalidRecord(f"missing keys {missing[:3]}{'...' if len(missing) > 3 else ''}")
    if extra:
        raise InvalidRecord(f"unexpected keys {extra[:3]}{'...' if len(extra) > 3 else ''}")
    for name, (shape, dtype) in spec.items():
        if name not in record:
            continue
        array = record[name]
        if tuple(array.shape) != tuple(shape):
            raise InvalidRecord(f"'{name}' has shape {tuple(array.shape)}, expected {tuple(shape)}")
        if array.dtype != dtype:
            raise InvalidRecord(f"'{name}' has dtype {array.dtype}, expected {dtype}")
        expected_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if len(array.data) > expected_bytes + 1024:
            raise InvalidRecord(
                f"'{name}' payload is {len(array.data)} bytes, expected ~{expected_bytes}"
            )
    try:
        tensors = from_array_record(record)
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
