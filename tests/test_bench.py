"""The benchmark suite's own pieces: the bare FedAvg reference and the byte counts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from bench.bare_loop import run_bare_fedavg
from bench.communication import parameter_bytes, wire_bytes
from bench.overrides import parse_overrides, to_set_args
from fedfm_flower.config import ExperimentConfig
from fedfm_flower.records import to_array_record
from server_apps.inprocess import run_in_process


def test_bare_loop_matches_the_framework_bit_for_bit(small_run_config: dict) -> None:
    """Same math, no Flower: the reference reaches exactly the framework's accuracies, so the
    overhead benchmark compares equal work."""
    config = {**small_run_config, "method": "fedavg", "num-server-rounds": 2}
    run_in_process(config, num_nodes=4)
    run_dir = next(Path(config["output-dir"]).glob("*/metrics.jsonl"))
    framework = [json.loads(line) for line in run_dir.read_text().splitlines()]
    experiment = ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **config})
    bare = run_bare_fedavg(experiment, num_clients=4, rounds=2)
    for ours, reference in zip(framework, bare["rounds"], strict=True):
        per_client = [ours["evaluate"][str(c)]["test-accuracy"] for c in range(4)]
        assert per_client == reference["test-accuracy"]


def test_wire_bytes_cover_the_parameters() -> None:
    tensors = {"a": torch.randn(64, 64), "b": torch.randn(10)}
    content = RecordDict({"arrays": to_array_record(tensors), "metrics": MetricRecord({"x": 1})})
    message = Message(content, dst_node_id=5, message_type="train")
    assert parameter_bytes(message) == (64 * 64 + 10) * 4
    wire = wire_bytes(message)
    assert parameter_bytes(message) < wire < parameter_bytes(message) + 4096
    empty = Message(
        RecordDict({"config": ConfigRecord({"k": 1})}), dst_node_id=5, message_type="train"
    )
    assert parameter_bytes(empty) == 0 and wire_bytes(empty) > 0


def test_overrides_round_trip() -> None:
    config = {"rounds": 3, "method": "fedrep", "flag": True, "lr": 0.05}
    args = to_set_args(config)
    assert parse_overrides(args[1::2]) == config
