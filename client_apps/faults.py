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
* ``metric-type``: ``num-examples`` is sent as a float (12.5), not an int;
* ``no-metrics``: the reply has no metrics record;
* ``crash``: the ClientApp raises instead of replying (Flower turns it into an error reply; in
  a fused message, which also carries the previous round's evaluation, the training part is
  reported as failed with the same reason and the evaluation still counts).

Faults that need a tensor apply to the ``arrays`` record; a reply without tensors is unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, RecordDict

from fedfm_flower import protocol as P
from fedfm_flower.config import ConfigError

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
    "metric-type",
    "no-metrics",
    "crash",
)


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
        if not round_text.strip().isdigit() or kind.strip() not in FAULT_KINDS:
            raise ConfigError(
                key,
                raw,
                f"expected 'round:kind,...' with kinds {', '.join(FAULT_KINDS)}",
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
