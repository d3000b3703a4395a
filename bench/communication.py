"""Communication: bytes on the wire per client and round against the parameters that must travel.

    python -m bench.communication [--methods fedavg fedrep ...] [--set key=value ...]

For each method one real training round runs in this process (the method's strategy, the real
ClientApp, two clients). Each training message and reply is measured three ways:

* ``parameters``: the tensors it carries, ``numel x itemsize`` (4 bytes per float32 parameter):
  what must travel;
* ``payload``: the bytes of its array records as the runner counts them (``bytes-up``/``-down``
  in ``metrics.jsonl``: ``np.save`` buffers plus their keys);
* ``wire``: the serialized size of every object Flower sends for the message (the message, its
  RecordDict, records and array chunks, each ``deflate()``-d as in transport), without the gRPC
  framing.

The ratio wire / parameters is the framework's overhead (target: at most 1.05).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from fedfm_flower.config.overrides import parse_overrides

METHODS = ("fedavg", "fedrep", "pfedseq", "pfedpg", "fedvpt", "fedvpt-deep", "local")


def wire_bytes(message: Any) -> int:
    """Bytes of every serialized object Flower transfers for ``message``."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())


def parameter_bytes(message: Any) -> int:
    """numel x itemsize of the tensors in the message's arrays record."""
    from fedfm_flower.records import protocol as P
    from fedfm_flower.records.messages import numpy_arrays

    record = message.content.array_records.get(P.ARRAYS)
    if record is None:
        return 0
    return sum(array.nbytes for array in numpy_arrays(record).values())


def measure_method(method: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """One training round of ``method`` with two clients; mean bytes per client each way."""
    from flwr.app import ArrayRecord, ConfigRecord

    from client_apps.app import app
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.models.build import prepare_foundation
    from fedfm_flower.records.messages import record_dict_nbytes
    from server_apps.inprocess import InProcessGrid, simulation_node_configs
    from server_apps.runner import build_strategy

    config = ExperimentConfig.from_run_config(
        {**ExperimentConfig().to_run_config(), **overrides, "method": method, "num-clients": 2}
    )
    prepare_foundation(config)
    strategy = build_strategy(config)
    grid = InProcessGrid(app, config.to_run_config(), simulation_node_configs(2))
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    replies = [r for r in grid.send_and_receive(messages) if not r.has_error()]
    if len(replies) != len(messages):
        raise RuntimeError(f"{method}: {len(messages) - len(replies)} client(s) failed")
    row: dict[str, Any] = {"method": method}
    for direction, batch in (("down", messages), ("up", replies)):
        params = statistics.fmean(parameter_bytes(m) for m in batch)
        wire = statistics.fmean(wire_bytes(m) for m in batch)
        row[f"{direction}-parameter-bytes"] = params
        row[f"{direction}-payload-bytes"] = statistics.fmean(
            record_dict_nbytes(m.content) for m in batch
        )
        row[f"{direction}-wire-bytes"] = wire
        row[f"{direction}-ratio"] = wire / params if params else None
    return row


def measure(methods: list[str], overrides: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method."""
    rows = []
    for method in methods:
        rows.append(measure_method(method, overrides))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: measure and print the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    measure(args.methods, parse_overrides(args.set))
    return 0


if __name__ == "__main__":
    sys.exit(main())
