"""Server cost of each strategy per round and how it grows with clients N, adapter size D and L.

    python -m bench.server_cost [--methods ...] [--clients 10 100] [--ranks 4 16] [--seq-lens 5 10]

The strategy runs alone in this process: a grid whose nodes only answer the identity query, and
synthetic training replies (the spec the strategy asks for, small random values) from every
client. Timed per round: ``configure_train`` + ``aggregate_train`` (building every client's
message, validating and aggregating every reply, and for pFedSeq/pFedPG the learner's step).
Reported: the median over the last rounds, after pFedSeq's history has filled up to L.
D is varied through ``lora-rank`` (LoRA methods) or ``vpt-num-prompts`` (prompt methods).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from fedfm_flower.config.overrides import parse_overrides

METHODS = ("fedavg", "fedrep", "pfedseq", "pfedpg")
PROMPT_METHODS = ("pfedpg", "fedvpt", "fedvpt-deep")


def synthetic_reply(message: Any, spec: dict, generator: torch.Generator) -> Any:
    """A valid training reply to ``message`` with small random tensors of the given spec."""
    from flwr.app import Message, MetricRecord, RecordDict

    from fedfm_flower.records import protocol as P
    from fedfm_flower.records.messages import to_message_record

    tensors = {
        name: (0.01 * torch.randn(shape, generator=generator)).to(getattr(torch, dtype))
        for name, (shape, dtype) in spec.items()
    }
    client_id = int(message.content[P.CONFIG][P.CLIENT_ID])
    metrics = MetricRecord({P.CLIENT_ID: client_id, P.NUM_EXAMPLES: 32, P.TRAIN_LOSS: 1.0})
    return Message(
        RecordDict({P.ARRAYS: to_message_record(tensors), P.METRICS: metrics}), reply_to=message
    )


def measure_one(
    method: str, num_clients: int, size: int, seq_len: int, rounds: int, overrides: dict
) -> dict[str, Any]:
    """Median server seconds per round of one (method, N, size, L) point."""
    from flwr.app import ArrayRecord, ConfigRecord

    from fedfm_flower.config.experiment import ExperimentConfig
    from server_apps.inprocess import InProcessGrid, identity_app, simulation_node_configs
    from server_apps.runner import build_strategy, prepare_foundation

    size_key = "vpt-num-prompts" if method in PROMPT_METHODS else "lora-rank"
    config = ExperimentConfig.from_run_config(
        {
            **ExperimentConfig().to_run_config(),
            **overrides,
            "method": method,
            "num-clients": num_clients,
            size_key: size,
            "pfedseq-seq-len": seq_len,
            "pfedseq-warmup-rounds": 1,
        }
    )
    prepare_foundation(config)
    strategy = build_strategy(config)
    grid = InProcessGrid(
        identity_app(), config.to_run_config(), simulation_node_configs(num_clients)
    )
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for server_round in range(1, rounds + 1):
        started = time.perf_counter()
        messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))
        configured = time.perf_counter()
        replies = [
            synthetic_reply(
                m,
                strategy.reply_spec(strategy.nodes.node_to_client[m.metadata.dst_node_id]),
                generator,
            )
            for m in messages
        ]
        aggregate_started = time.perf_counter()
        strategy.aggregate_train(server_round, replies)
        seconds.append((configured - started) + (time.perf_counter() - aggregate_started))
    dimension = sum(
        int(torch.Size(shape).numel())
        for shape, _ in strategy.reply_spec(strategy.clients()[0]).values()
    )
    return {
        "method": method,
        "clients": num_clients,
        size_key: size,
        "D": dimension,
        "L": seq_len if method == "pfedseq" else None,
        "server-s": statistics.median(seconds[-3:]),
        "rounds": rounds,
    }


def measure(
    methods: list[str], clients: list[int], ranks: list[int], seq_lens: list[int], overrides: dict
) -> list[dict[str, Any]]:
    """The grid: every method at every N with the first size; size and L scans at the first N."""
    points = []
    for method in methods:
        sizes = [10, 40] if method in PROMPT_METHODS else ranks
        for num_clients in clients:
            points.append((method, num_clients, sizes[0], seq_lens[0]))
        for size in sizes[1:]:
            points.append((method, clients[0], size, seq_lens[0]))
        if method == "pfedseq":
            for seq_len in seq_lens[1:]:
                points.append((method, clients[0], sizes[0], seq_len))
    rows = []
    for method, num_clients, size, seq_len in points:
        rounds = seq_len + 3 if method == "pfedseq" else 4
        rows.append(measure_one(method, num_clients, size, seq_len, rounds, overrides))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: measure and print the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[5, 10])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    measure(args.methods, args.clients, args.ranks, args.seq_lens, parse_overrides(args.set))
    return 0


if __name__ == "__main__":
    sys.exit(main())
