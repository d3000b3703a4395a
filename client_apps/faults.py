"""Fault injection: a SuperNode's node config can make its ClientApp send malformed replies.

For testing a deployment's defences over real processes (``tests/test_faults.py``), never for
experiments. A node started with

    flower-supernode ... --node-config 'client-id=0 inject-fault="2:nan,3:shape"'

corrupts its training reply of round 2 with NaN values and that of round 3 with a wrong shape;
every other message is left alone. Without the node config key, the environment variable
``FEDFM_INJECT_FAULT`` (same syntax) applies to every ClientApp that inherits it: all simulated
clients of one ``flwr run``, or every SuperNode started with it. Kinds (``FAULT_KINDS``):

* ``nan`` / ``inf``: the first value of the first tensor becomes NaN / +Inf;
* ``shape``: the first tensor loses its last element;
* ``dtype``: the first tensor is sent as float64;
* ``missing-key`` / ``extra-key``: the first tensor is dropped / an unexpected tensor is added;
* ``client-id``: the reply claims the next client id;
* ``oversize``: the first tensor keeps its declared shape and dtype but carries 100x the bytes;
* ``torn-pack``: the packed tensors (``fedfm_flower.records.packed_arrays``) lose their last byte;
* ``metric-type``: ``num-examples`` is sent as a float (12.5), not an int;
* ``no-metrics``: the reply has no metrics record;
* ``crash``: the ClientApp raises instead of replying (Flower turns it into an error reply; in
  a fused message, which also carries the previous round's evaluation, the training part is
  reported as failed with the same reason and the evaluation still counts).

Faults that need a tensor apply to the ``arrays`` record; a reply without tensors is unchanged.
The tensor faults other than ``torn-pack`` lay the record out as one ``Array`` per tensor
first (the form other clients may send, read alike by the server), so each names one tensor.

One kind breaks the client's state instead of its reply (``STATE_FAULT_KINDS``):

* ``stall-save``: the write of this round's personal state stops half-way, its temporary file
  holding half the bytes, and waits ``STALL_S`` to be killed (the chaos harness,
  ``fedfm_flower.deploy.chaos``, SIGKILLs the node then: a kill mid-write); if nobody does, the
  write fails and the training with it, so no torn state is ever committed.

One kind only delays (``HOLD_KINDS``), so a test can order a round after an event:

* ``hold``: the training waits until a file ``release`` exists in the client's state directory
  (``<client-state-dir>/<run-name>/client_<id>/``; the test creates it), at most ``HOLD_S``,
  then runs as usual.

Imports inside functions keep ``safetensors`` out of this module's start-up.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict

from fedfm_flower.config.experiment import ConfigError
from fedfm_flower.records import protocol as P
from fedfm_flower.records.durable import atomic_path, save_tensors
from fedfm_flower.records.messages import numpy_arrays
from fedfm_flower.records.packed_arrays import pack

log = logging.getLogger(__name__)

NODE_CONFIG_KEY = "inject-fault"
ENVIRONMENT_VARIABLE = "FEDFM_INJECT_FAULT"
FAULT_KINDS = (
    "nan",
    "inf",
    "shape",
    "dtype",
    "missing-key",
    "extra-key",
    "client-id",
    "oversize",
    "torn-pack",
    "metric-type",
    "no-metrics",
    "crash",
)
STATE_FAULT_KINDS = ("stall-save",)
STALL_S = 600.0  # how long a stalled state write waits to be killed
HOLD_KINDS = ("hold",)
HOLD_S = 300.0  # how long a held training waits for its release at most
RELEASE_FILE = "release"


class InjectedCrash(RuntimeError):
    """The ``crash`` fault: the ClientApp fails on purpose."""


def parse_faults(
    node_config: Mapping[str, Any], environ: Mapping[str, str] = os.environ
) -> dict[int, str]:
    """Round -> fault kind from ``inject-fault`` ("2:nan,3:shape") of the node config, else of
    the environment; {} if neither has one."""
    raw = node_config.get(NODE_CONFIG_KEY, "")
    key, source = NODE_CONFIG_KEY, "node config"
    if not raw:
        raw = environ.get(ENVIRONMENT_VARIABLE, "")
        key, source = ENVIRONMENT_VARIABLE, "environment"
    if not raw:
        return {}
    faults: dict[int, str] = {}
    for item in str(raw).split(","):
        round_text, _, kind = item.strip().partition(":")
        kinds = FAULT_KINDS + STATE_FAULT_KINDS + HOLD_KINDS
        if not round_text.strip().isdigit() or kind.strip() not in kinds:
            raise ConfigError(
                key,
                raw,
                f"expected 'round:kind,...' with kinds {', '.join(kinds)}",
                source=source,
            )
        faults[int(round_text)] = kind.strip()
    return faults


def inject_fault(content: RecordDict, kind: str) -> RecordDict:
    """Corrupt a training reply's ``content`` in place as ``kind`` says; returns it."""
    if kind == "crash":
        raise InjectedCrash("fault injection: this ClientApp crashes on purpose")
    if kind == "client-id":
        metrics = content.metric_records[P.METRICS]
        metrics[P.CLIENT_ID] = int(metrics[P.CLIENT_ID]) + 1
        return content
    if kind == "metric-type":
        content.metric_records[P.METRICS][P.NUM_EXAMPLES] = 12.5
        return content
    if kind == "no-metrics":
        del content[P.METRICS]
        return content
    arrays = content.array_records.get(P.ARRAYS)
    if arrays is None or not len(arrays):
        return content
    plain = numpy_arrays(arrays)
    if kind == "torn-pack":
        whole = pack(plain)
        torn = Array(dtype=whole.dtype, shape=whole.shape, stype=whole.stype, data=whole.data[:-1])
        content[P.ARRAYS] = ArrayRecord({"torn": torn})
        return content
    arrays = ArrayRecord({name: Array(values) for name, values in plain.items()})
    content[P.ARRAYS] = arrays
    name = next(iter(arrays))
    values = arrays[name].numpy()
    if kind in ("nan", "inf"):
        values = values.copy()
        values.reshape(-1)[0] = np.nan if kind == "nan" else np.inf
        arrays[name] = Array(values)
    elif kind == "shape":
        arrays[name] = Array(values.reshape(-1)[:-1].copy())
    elif kind == "dtype":
        arrays[name] = Array(values.astype(np.float64))
    elif kind == "missing-key":
        del arrays[name]
    elif kind == "extra-key":
        arrays[f"{name}.extra"] = Array(np.zeros(4, dtype=np.float32))
    elif kind == "oversize":
        honest = arrays[name]
        arrays[name] = Array(
            dtype=honest.dtype, shape=honest.shape, stype=honest.stype, data=honest.data * 100
        )
    return content


def stall_state_write(store: Any, seconds: float = STALL_S) -> None:
    """Make ``store``'s next state file write stop half-way and wait ``seconds`` (the
    ``stall-save`` fault); it then raises, and the temporary file is removed. Once per file: a
    mark beside it (``.stalled-<name>``) makes a replay of the round, after the node was killed
    and started again, write normally."""
    from safetensors.torch import save_file

    def stalled(path: Path, tensors: dict[str, torch.Tensor]) -> str:
        once = path.parent / f".stalled-{path.name}"  # a restarted node writes it normally
        if once.exists():
            return save_tensors(path, tensors)
        path.parent.mkdir(parents=True, exist_ok=True)
        once.touch()
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp))
            size = tmp.stat().st_size
            with open(tmp, "r+b") as handle:
                handle.truncate(size // 2)
                handle.flush()
                os.fsync(handle.fileno())
            log.warning("inject-fault: the write of %s stalls half-way (%s)", path.name, tmp.name)
            time.sleep(seconds)
            raise InjectedCrash(f"fault injection: the write of {path.name} was not killed")

    store.write_file = stalled


def hold_until_released(directory: Path | None, seconds: float = HOLD_S) -> None:
    """Wait until ``directory``/``release`` exists (the ``hold`` kind), at most ``seconds``."""
    if directory is None:
        raise ConfigError(
            NODE_CONFIG_KEY,
            "hold",
            "needs a client-state-dir to watch for its release",
            source="node config",
        )
    release = directory / RELEASE_FILE
    log.warning("inject-fault: training held until %s exists", release)
    deadline = time.monotonic() + seconds
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
