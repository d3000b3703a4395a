"""Conversions between torch tensors and Flower records, keyed by parameter name.

Replies are never deserialized with pickle: Flower's ``Array`` stores ``np.save`` bytes and
loads them with ``allow_pickle=False``; shapes and dtypes are checked from the metadata before
any array is decoded, so an oversized or malformed payload is rejected cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict


def to_array_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Pack named tensors into an ArrayRecord (copied to CPU, order kept)."""
    record = ArrayRecord()
    for name, tensor in tensors.items():
        record[name] = Array(tensor.detach().cpu().contiguous().numpy())
    return record


def from_array_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """Unpack an ArrayRecord into named CPU tensors."""
    return {name: torch.from_numpy(np.array(array.numpy())) for name, array in record.items()}


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
    in the decoded values).
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
        if not torch.isfinite(tensor).all():
            raise InvalidRecord(f"'{name}' contains NaN or Inf")
    return tensors
