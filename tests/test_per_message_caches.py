"""What a warm ClientApp remembers between messages gives exactly what recomputing gives:
the ``.npy`` headers of tensor records, the parsed run config, the grouped-parameter lookup."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from client_apps.base import parsed_run_config
from fedfm_flower.config.experiment import ConfigError, ExperimentConfig
from fedfm_flower.models.groups import GroupPattern, TunedModel
from fedfm_flower.records.messages import (
    decode_array,
    encode_array,
    from_array_record,
    to_array_record,
)

ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.zeros((0, 5), dtype=np.float32),
    np.array(3.5),
    np.arange(7, dtype=np.int64),
    np.array([True, False, True]),
    np.linspace(-1, 1, 6, dtype=np.float16).reshape(2, 3),
    np.arange(24, dtype=np.float64).reshape(2, 3, 4),
]


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_encoding_is_byte_for_byte_np_save_and_decoding_is_np_load(array: np.ndarray) -> None:
    for _ in range(3):  # the first call goes through np.save and remembers the header
        encoded, reference = encode_array(array), Array(array)
        assert (encoded.dtype, encoded.shape, encoded.stype) == (
            reference.dtype,
            reference.shape,
            reference.stype,
        )
        assert encoded.data == reference.data
        decoded, expected = decode_array(encoded), np.array(reference.numpy())
        assert decoded.dtype == expected.dtype and decoded.shape == expected.shape
        assert decoded.tobytes() == expected.tobytes()
        assert decoded.flags.writeable and decoded.flags.c_contiguous


def test_arrays_not_laid_out_as_remembered_take_np_save_and_np_load() -> None:
    encode_array(np.zeros((3, 4)))  # the C-order header of float64 (3, 4) is remembered
    fortran = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    assert encode_array(fortran).data == Array(fortran).data
    assert np.array_equal(decode_array(Array(fortran)), fortran)
    strided = np.arange(24.0).reshape(4, 6)[:, ::2]
    assert encode_array(strided).data == Array(strided).data
    big_endian = np.arange(12, dtype=">f4").reshape(3, 4)
    assert encode_array(big_endian).data == Array(big_endian).data
    assert decode_array(encode_array(big_endian)).dtype == np.dtype(">f4")


def test_payloads_that_break_the_remembered_header_decode_as_np_load_does() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    encode_array(array)  # remembered
    good = encode_array(array)
    # A payload with trailing bytes: np.load reads the array and ignores the rest.
    trailing = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data + b"xx")
    assert np.array_equal(decode_array(trailing), array)
    # Metadata that disagrees with the payload's own header: np.load follows the header.
    buffer = io.BytesIO()
    np.save(buffer, array.reshape(3, 2))
    lying = Array(dtype="float32", shape=(2, 3), stype=good.stype, data=buffer.getvalue())
    assert decode_array(lying).shape == (3, 2)
    # A payload cut short fails as np.load fails.
    short = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data[:-4])
    with pytest.raises(ValueError):
        np.array(short.numpy())
    with pytest.raises(ValueError):
        decode_array(short)


def test_tensor_records_round_trip_and_decode_to_fresh_tensors() -> None:
    tensors = {"a": torch.randn(4, 3), "b": torch.arange(5), "c": torch.tensor(2.0)}
    record = to_array_record(tensors)
    assert isinstance(record, ArrayRecord)
    for _ in range(2):
        decoded = from_array_record(record)
        assert list(decoded) == list(tensors)
        for name, tensor in tensors.items():
            assert decoded[name].dtype == tensor.dtype and torch.equal(decoded[name], tensor)
        decoded["a"].add_(1.0)  # writable, and the record is untouched
        assert torch.equal(from_array_record(record)["a"], tensors["a"])


def test_the_run_config_is_parsed_once_per_content_and_type() -> None:
    full = ExperimentConfig().to_run_config()
    first = parsed_run_config(dict(full, method="fedavg"))
    assert parsed_run_config(dict(full, method="fedavg")) is first  # a fresh mapping, same content
    assert first == ExperimentConfig.from_run_config(dict(full, method="fedavg"))
    # Equal in Python, parsed differently: a str field takes 2 as "2" and 2.0 as "2.0".
    as_int = parsed_run_config(dict(full, **{"run-name": 2}))
    as_float = parsed_run_config(dict(full, **{"run-name": 2.0}))
    assert (as_int.run_name, as_float.run_name) == ("2", "2.0")
    # True is 1 in Python, but an int key refuses a bool: on every message, not only the first.
    assert parsed_run_config(dict(full, **{"local-epochs": 1})).local_epochs == 1
    for _ in range(2):
        with pytest.raises(ConfigError, match="local-epochs"):
            parsed_run_config(dict(full, **{"local-epochs": True}))


class Tiny(TunedModel):
    """A frozen body and a head: the smallest model with grouped parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4).requires_grad_(False)
        self.head = torch.nn.Linear(4, 3)
        self.group_patterns = (GroupPattern("head", r"^head\."),)


def test_grouped_parameters_follow_the_model_through_to() -> None:
    model = Tiny()
    groups = model.parameter_groups()
    groups["head.bias"] = "changed"  # a copy: the model's lookup is untouched
    assert model.parameter_groups()["head.bias"] == "head"
    model.to(torch.float64)  # replaces every parameter
    values = {n: torch.full_like(t, 0.5) for n, t in model.trainable().tensors.items()}
    model.load_tensors(values)
    loaded = dict(model.named_parameters())
    assert all(loaded[n].dtype == torch.float64 and torch.all(loaded[n] == 0.5) for n in values)
    before = model.trainable().tensors
    with pytest.raises(KeyError, match="no trainable parameter"):
        model.load_tensors({"head.bias": torch.zeros(3), "not.a.parameter": torch.zeros(1)})
    after = model.trainable().tensors
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing copied
