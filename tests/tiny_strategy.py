"""A FedAvg-family strategy over a tiny adapter and head, and rounds played on it by hand (the
strategy tests of privacy and SecAgg+)."""

from __future__ import annotations

import torch
from flwr.app import Message, RecordDict

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import from_array_record, to_array_record

TINY = {"adapter.a": (4, 3), "head.w": (2,)}
# Settings that fit a method's split to the tiny adapter and head.
TINY_SPLITS: dict[str, dict[str, str]] = {"fedperfix": {"fedperfix-personal": "head"}}


def tiny_strategy(config: ExperimentConfig):  # noqa: ANN201
    """A FedAvg-family strategy over a tiny adapter and head, and a grid of 3 identity nodes."""
    from fedfm_flower.methods.halves import strategy_class
    from fedfm_flower.models import TrainableTensors
    from server_apps.inprocess import InProcessGrid, identity_app

    initial = TrainableTensors(
        {n: torch.zeros(shape) for n, shape in TINY.items()},
        {"adapter.a": "adapter", "head.w": "head"},
    )
    grid = InProcessGrid(
        identity_app(), config.to_run_config(), [{"client-id": i} for i in range(3)]
    )
    return strategy_class(config.method)(config, initial), grid


def play(strategy, grid, rounds) -> dict:  # noqa: ANN001
    """Rounds where client c sends what it got plus (c + t) everywhere; the last round's
    server metrics."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

    metrics = {}
    for t in rounds:
        messages = list(strategy.configure_train(t, ArrayRecord(), ConfigRecord(), grid))
        replies = []
        for m in messages:
            client = int(m.content[P.CONFIG][P.CLIENT_ID])
            got = from_array_record(m.content[P.ARRAYS])
            sent = {n: a + (client + t) for n, a in got.items()}
            content = RecordDict(
                {
                    P.ARRAYS: to_array_record(sent),
                    P.METRICS: MetricRecord({P.CLIENT_ID: client, P.NUM_EXAMPLES: 5}),
                }
            )
            replies.append(Message(content, reply_to=m))
        metrics = strategy.aggregate_round(t, None, replies).server_metrics
    return metrics
