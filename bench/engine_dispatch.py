"""What one message costs in Flower's Ray backend alone: a no-op ClientApp, a FedAvg-sized payload.

    python -m bench.engine_dispatch [--messages 300] [--warmup 50]

The simulation engine hands each message to a Ray actor (``RayBackend.process_message``): the
ClientApp loader, the message and the node's context are pickled to the actor, the ClientApp
runs, and the reply and the updated context come back. Here the ClientApp echoes the received
arrays (the default setup's FedAvg payload: its model's trainable tensors, seeded, ~19 KB) and
the context carries the full default run config, so what is timed is the dispatch, not any work.
Compare with ``bench.message_cost`` (our ClientApp's own part) and ``bench.simulation_overhead``
(the whole gap to the bare loop).

Writes ``bench/results/engine_dispatch/results.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def fedavg_payload() -> dict[str, np.ndarray]:
    """What FedAvg sends on the default setup: the model's trainable tensors (no weights read)."""
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.methods.registry import tuner_of
    from fedfm_flower.models.build import build_model

    config = ExperimentConfig(method="fedavg")
    model = build_model(config, tuner_of(config), 10, load_weights=False)
    return {name: t.numpy() for name, t in model.trainable().tensors.items()}


def measure(messages: int, warmup: int, nodes: int = 100) -> dict[str, float]:
    """Median, 10th and 90th percentile milliseconds per message after ``warmup`` messages."""
    import ray
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
    from flwr.supercore.task_identity import TaskIdentity

    from fedfm_flower.config.experiment import ExperimentConfig

    app = ClientApp()

    @app.train()
    def echo(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)

    # Messages built outside a Flower process need the identity a ServerApp process has.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    payload = fedavg_payload()
    arrays = ArrayRecord(list(payload.values()))
    run_config = ExperimentConfig().to_run_config()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    backend = RayBackend({"client_resources": {"num_cpus": 2, "num_gpus": 0.0}, "init_args": {}})
    backend.build(lambda: app)
    times: list[float] = []
    try:
        for i in range(warmup + messages):
            node = i % nodes + 1
            content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})})
            message = Message(content, dst_node_id=node, message_type="train")
            message.metadata.__dict__["_message_id"] = f"message-{i}"
            context = Context(
                run_id=1,
                node_id=node,
                node_config={"partition-id": node - 1, "num-partitions": nodes},
                state=RecordDict(),
                run_config=run_config,
            )
            started = time.perf_counter()
            reply, _ = backend.process_message(message, context)
            times.append(time.perf_counter() - started)
            if reply.has_error():
                raise RuntimeError(f"the echo ClientApp failed: {reply.error}")
    finally:
        backend.terminate()
        ray.shutdown()
    timed = sorted(times[warmup:])
    return {
        "messages": len(timed),
        "median-ms": 1000 * statistics.median(timed),
        "p10-ms": 1000 * timed[len(timed) // 10],
        "p90-ms": 1000 * timed[(9 * len(timed)) // 10],
        "payload-bytes": sum(array.nbytes for array in payload.values()),
        "run-config-keys": len(run_config),
    }


def main(argv: list[str] | None = None) -> int:
    """Measure, print and write the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engine_dispatch")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.warmup < 0:
        parser.error(
            f"--messages must be >= 1 and --warmup >= 0, got {args.messages}, {args.warmup}"
        )
    result = {"date": time.strftime("%Y-%m-%d"), **measure(args.messages, args.warmup)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
