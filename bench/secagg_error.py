"""How far SecAgg+'s mean lies from the plain weighted mean, with the default settings.

    python -m bench.secagg_error --out bench/results/secagg_error

Flower's client mod and our server driver (``fedfm_flower.privacy.secagg``) on ``--clients``
in-process clients whose updates are ``--scale`` x N(0, 1) over ``--values`` coordinates, with
the run config's defaults (``secagg-clipping-range`` 8, ``secagg-quantization-range`` 2**22,
``secagg-max-weight`` 1000), each weighting ``--repeats`` times: example weights (client i has
``--examples`` x (0.5 + i / clients) examples, about digits' partitions) and uniform weights.
Per weighting it records the largest and the RMS error over all values and repeats, and the
two figures the quantization predicts: each client's w x is rounded stochastically to a step
s = 2 range / levels, so the mean's error is at most k s / sum(w) for k clients (w = weight /
max-weight), and its RMS about s sqrt(k / 6) / sum(w) (a uniform fractional part rounds with
variance s^2 / 6). Writes ``secagg_error.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from client_apps.secagg import secagg_mod
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.privacy.secagg import SecAggSettings, secure_exchange
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import from_array_record, to_array_record
from server_apps.inprocess import InProcessGrid


class GaussianUpdates:
    """A ClientApp stand-in: client c sends received + its update, with its example count."""

    def __init__(self, updates: dict[int, np.ndarray], examples: dict[int, int]) -> None:
        self.updates = updates
        self.examples = examples

    def __call__(self, message: Message, context: Context) -> Message:
        client = int(context.node_config["partition-id"])
        received = from_array_record(message.content[P.ARRAYS])
        trained = {"x": received["x"] + torch.from_numpy(self.updates[client])}
        metrics = MetricRecord({P.CLIENT_ID: client, P.NUM_EXAMPLES: self.examples[client]})
        content = RecordDict({P.ARRAYS: to_array_record(trained), P.METRICS: metrics})
        return Message(content, reply_to=message)


def measure(args: argparse.Namespace, weighting: str, settings: SecAggSettings) -> dict:
    """Largest and RMS error of the secure mean over ``args.repeats`` rounds, and the bounds."""
    k = args.clients
    examples = {c: round(args.examples * (0.5 + c / k)) for c in range(k)}
    rng = np.random.default_rng(args.seed)
    errors = []
    for _ in range(args.repeats):
        updates = {
            c: (args.scale * rng.standard_normal(args.values)).astype(np.float32) for c in range(k)
        }
        inner = GaussianUpdates(updates, examples)

        def app(message: Message, context: Context, inner: GaussianUpdates = inner) -> Message:
            return secagg_mod(message, context, inner)

        grid = InProcessGrid(app, {}, [{"partition-id": c} for c in range(k)])
        messages = [
            Message(
                RecordDict(
                    {
                        P.ARRAYS: to_array_record({"x": torch.zeros(args.values)}),
                        P.CONFIG: ConfigRecord({P.CLIENT_ID: c, P.SERVER_ROUND: 1}),
                    }
                ),
                dst_node_id=1001 + c,
                message_type=MessageType.TRAIN,
                group_id="1",
            )
            for c in range(k)
        ]
        outcome = secure_exchange(grid, messages, settings, None, weighting)
        assert outcome.mean is not None, "the protocol did not finish"
        weights = [1.0 if weighting == "uniform" else float(examples[c]) for c in range(k)]
        plain = sum(w * updates[c].astype(np.float64) for c, w in enumerate(weights)) / sum(weights)
        errors.append(outcome.mean.update["x"].numpy() - plain)
    error = np.concatenate(errors)
    step = 2 * settings.clipping_range / settings.quantization_range
    ratio = sum(
        (settings.max_weight if weighting == "uniform" else examples[c]) / settings.max_weight
        for c in range(k)
    )
    return {
        "weighting": weighting,
        "clients": k,
        "sum-of-w": ratio,
        "step": step,
        "max-error": float(np.abs(error).max()),
        "rms-error": float(np.sqrt(np.mean(error**2))),
        "bound": k * step / ratio,
        "predicted-rms": step * math.sqrt(k / 6) / ratio,
        "values": int(error.size),
    }


def main() -> None:
    """Measure both weightings and write the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--values", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--examples", type=int, default=140)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = SecAggSettings.of(ExperimentConfig())
    rows = [measure(args, weighting, settings) for weighting in ("examples", "uniform")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "secagg_error.json").write_text(json.dumps(rows, indent=2))
    print("| weights | k | sum of w | max error | bound k s / sum w | RMS | predicted RMS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['weighting']} | {r['clients']} | {r['sum-of-w']:.2f} | {r['max-error']:.2e} "
            f"| {r['bound']:.2e} | {r['rms-error']:.2e} | {r['predicted-rms']:.2e} |"
        )


if __name__ == "__main__":
    main()
