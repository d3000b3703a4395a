"""End-to-end runs of the real ServerApp loop and ClientApp in one process (no Ray)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from client_apps.faults import inject_fault
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods import registry
from fedfm_flower.methods.registry import METHODS, tuner_of
from fedfm_flower.models import MODEL_CACHE, backbone_fingerprint, build_model, initial_trainable
from fedfm_flower.models.groups import TrainableTensors
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import from_array_record, record_names
from server_apps.inprocess import ServerCrash, crash_in_round, run_in_process

# Methods that serve image models (FedDPA's are for causal LMs: tests/test_feddpa.py).
# per-fedavg-ft trains as per-fedavg; it runs end to end on TAP's federation (tests/test_tap.py).
IMAGE_METHODS = sorted(
    m
    for m, s in METHODS.items()
    if (not s.modalities or "image" in s.modalities) and m != "per-fedavg-ft"
)


def _initial(config: dict) -> tuple[ExperimentConfig, TrainableTensors]:
    run = ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **config})
    initial = initial_trainable(
        run, tuner_of(run), 10, train_backbone=registry.trains_backbone(run)
    )
    return run, initial


def _groups(keys, config: dict) -> set[str]:
    _, initial = _initial(config)
    return {initial.groups.get(k, "backbone") for k in keys}


def _split_groups(config: dict) -> tuple[set[str], set[str]]:
    """(groups the method shares, groups it keeps and does not share), from its spec."""
    run, initial = _initial(config)
    shared, local = registry.split_parameters(run, initial.groups)
    shared_groups = {initial.groups[n] for n in shared}
    return shared_groups, {initial.groups[n] for n in local} - shared_groups


@pytest.mark.parametrize("method", IMAGE_METHODS)
def test_each_baseline_runs_two_rounds(method: str, small_run_config: dict) -> None:
    config = {**small_run_config, "method": method}
    summary, grid = run_in_process(config, num_nodes=4)
    assert summary["rounds"] == 2
    assert 0.2 < summary["final-test-accuracy-mean"] <= 1.0  # chance is 0.1
    assert set(summary["final-per-client-accuracy"]) == {"0", "1", "2", "3"}
    # Only the method's shared groups travel (its spec's split), never a backbone tensor, and
    # never a group it keeps.
    shared, kept = _split_groups(config)
    assert "backbone" not in shared
    own = registry.method_spec(method).message_prefix  # its entries beside the model's tensors
    for message in grid.sent:
        arrays = message.content.array_records.get(P.ARRAYS)
        keys = set(record_names(arrays)) if arrays is not None else set()
        keys = {k for k in keys if not (own and k.startswith(own))}
        assert _groups(keys, config) <= shared and not _groups(keys, config) & kept
        if message.metadata.message_type == "train":
            assert _groups(keys, config) == shared
    run_dir = Path(config["output-dir"]) / summary["run-name"]
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    for record in rounds:
        assert record["clients-reported"] == (1 if method == "centralized" else 4)
        assert not math.isnan(record["test-accuracy-mean"])
        assert record["bytes-down"] > 0 or method == "local"
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["run-config"]["method"] == method
    assert saved["foundation"]["public_test_accuracy"] > 0.6
    assert (run_dir / "summary.json").is_file()
    assert (run_dir / "checkpoints" / "round_00002.safetensors").is_file()


@pytest.mark.parametrize("method", ["fedavg", "per-fedavg-lora"])
def test_client_training_leaves_the_frozen_backbone_bit_identical(
    method: str, small_run_config: dict
) -> None:
    """FedAvg, and Per-FedAvg on the trainable parameters (pFedSeq's tables' form: LoRA +
    head, where ``per-fedavg`` trains the whole ViT), never change the frozen backbone."""
    run_in_process({**small_run_config, "method": method}, num_nodes=4)
    config = ExperimentConfig.from_run_config(
        {**ExperimentConfig().to_run_config(), **small_run_config, "method": method}
    )
    resolved = registry.resolve(config)
    assert (resolved.tuner, resolved.trains_backbone) == ("lora", False)
    trained = MODEL_CACHE._model  # the model the clients trained in this process
    assert trained is not None
    fresh = build_model(config, "lora", 10)
    assert backbone_fingerprint(trained.backbone) == backbone_fingerprint(fresh.backbone)


def test_personal_heads_stay_on_their_clients(small_run_config: dict, tmp_path: Path) -> None:
    config = {**small_run_config, "method": "fedrep", "client-state-dir": str(tmp_path / "st")}
    summary, grid = run_in_process(config, num_nodes=4)
    heads = {}
    for client_dir in sorted((tmp_path / "st" / summary["run-name"]).iterdir()):
        from safetensors.torch import load_file

        files = sorted(client_dir.glob("round_*.safetensors"))
        heads[client_dir.name] = load_file(files[-1])["head.weight"]
    assert len(heads) == 4
    values = list(heads.values())
    assert all(not torch.equal(values[0], other) for other in values[1:])
    for message in grid.sent:  # no head ever left or reached a client
        arrays = message.content.array_records.get(P.ARRAYS)
        assert arrays is None or not any(k.startswith("head.") for k in record_names(arrays))


def test_a_failing_client_does_not_stop_the_round(small_run_config: dict) -> None:
    def break_client_2(client_id, reply):
        if client_id == 2 and reply.metadata.message_type == "train":
            inject_fault(reply.content, "nan")
        return reply

    summary, _ = run_in_process({**small_run_config, "method": "fedavg"}, 4, break_client_2)
    run_dir = Path(small_run_config["output-dir"]) / summary["run-name"]
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in rounds:
        assert record["clients-reported"] == 3
        assert "NaN" in record["rejected"]["2"]
    assert summary["final-test-accuracy-mean"] > 0.2


@pytest.mark.parametrize("method", ["fedrep", "pfedseq", "pfedpg"])
def test_partial_participation_and_missing_clients(small_run_config: dict, method: str) -> None:
    dropped = []

    def drop_client_1(client_id, reply):
        if client_id == 1 and reply.metadata.message_type == "train":
            dropped.append(client_id)
            return None  # as if the node vanished mid-round
        return reply

    config = {
        **small_run_config,
        "method": method,
        "fraction-train": 0.5,
        "num-server-rounds": 3,
        "pfedseq-warmup-rounds": 1,
    }
    summary, _ = run_in_process(config, 4, drop_client_1)
    run_dir = Path(config["output-dir"]) / summary["run-name"]
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["clients-sampled"] == 2 for r in rounds)
    assert len({tuple(r["sampled"]) for r in rounds}) > 1  # the sample changes by round
    for record in rounds:
        if 1 in record["sampled"]:
            assert record["missing"] == [1]
            assert record["clients-reported"] == 1
        else:
            assert record["missing"] == []
            assert record["clients-reported"] == 2
    assert dropped, "client 1 was never sampled; pick another seed"
    assert summary["rounds"] == 3


@pytest.mark.parametrize("method", ["fedrep", "pfedseq", "pfedpg"])
def test_resume_after_a_crash_gives_the_same_final_metrics(
    small_run_config: dict, tmp_path: Path, method: str
) -> None:
    base = {
        **small_run_config,
        "method": method,
        "num-server-rounds": 3,
        "pfedseq-warmup-rounds": 1,
        "client-state-dir": str(tmp_path / "state"),
        "local-steps": 2,  # the two runs agree whatever the training does
    }
    full, _ = run_in_process({**base, "run-name": "uninterrupted"}, 4)

    with pytest.raises(ServerCrash):  # the ServerApp dies while round 3 is under way
        run_in_process({**base, "run-name": "crashed"}, 4, crash_in_round(3))
    run_dir = Path(base["output-dir"]) / "crashed"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    # Fresh contexts (a new `flwr run`): clients recover their state from client-state-dir.
    resumed, _ = run_in_process({**base, "run-name": "crashed", "resume": True}, 4)
    assert resumed["rounds"] == 3
    assert resumed["final-per-client-accuracy"] == full["final-per-client-accuracy"]
    assert resumed["final-test-accuracy-mean"] == full["final-test-accuracy-mean"]
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3]


def test_default_local_training_is_stable_with_few_large_clients(small_run_config: dict) -> None:
    # Regression: lr 0.05 with momentum 0.9 made FedRep collapse from 64% to 13% in round 2
    # when 2 clients held ~270 training samples each.
    config = {**small_run_config, "method": "fedrep", "num-clients": 2, "num-server-rounds": 3}
    summary, _ = run_in_process(config, 2)
    run_dir = Path(config["output-dir"]) / summary["run-name"]
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accuracies = [r["test-accuracy-mean"] for r in rounds]
    assert min(accuracies) > 0.6, accuracies
    assert accuracies[-1] >= accuracies[0] - 0.05, accuracies


def test_an_existing_run_is_never_overwritten(small_run_config: dict) -> None:
    config = {**small_run_config, "num-server-rounds": 1, "run-name": "taken"}
    run_in_process(config, 4)
    with pytest.raises(FileExistsError, match="resume=true"):
        run_in_process(config, 4)


def test_pfedseq_sends_each_client_its_own_personalized_adapter(small_run_config: dict) -> None:
    from safetensors.torch import load_file

    from fedfm_flower.learners.layout import ParameterLayout

    config = {**small_run_config, "method": "pfedseq", "num-server-rounds": 3}
    config["pfedseq-warmup-rounds"] = 1
    summary, grid = run_in_process(config, 4)
    run_dir = Path(config["output-dir"]) / summary["run-name"]
    state = load_file(str(run_dir / "checkpoints" / "round_00002.safetensors"))
    personal = state["personal"]  # theta_i after round 2, what round 3 must send
    assert not torch.allclose(personal[0], personal[1])
    round3 = [
        m for m in grid.sent if m.metadata.message_type == "train" and m.metadata.group_id == "3"
    ]
    assert len(round3) == 4
    for message in round3:
        client = int(message.content[P.CONFIG][P.CLIENT_ID])
        sent = from_array_record(message.content[P.ARRAYS])
        assert _groups(sent, config) == {"adapter"}
        layout = ParameterLayout(sent)
        torch.testing.assert_close(layout.flatten(sent), personal[client], rtol=0, atol=0)
    run = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert run[0]["server"]["pfedseq-warmup"] == 1.0 and run[1]["server"]["pfedseq-warmup"] == 0.0
    assert run[2]["server"]["pfedseq-calibration-rms"] > 0


def test_pfedseq_sizes_its_learner_from_the_nodes_and_leaves_out_foreign_ids(
    small_run_config: dict, caplog: pytest.LogCaptureFixture
) -> None:
    from safetensors.torch import load_file

    nodes = [{"client-id": i, "partition-id": i, "num-partitions": 3} for i in range(3)]
    nodes[2]["client-id"] = 7  # a deployment node numbered outside 0..N-1
    config = {**small_run_config, "method": "pfedseq", "num-clients": 0, "num-server-rounds": 1}
    summary, grid = run_in_process(config, 3, node_configs=nodes)
    run_dir = Path(config["output-dir"]) / summary["run-name"]
    state = load_file(str(run_dir / "checkpoints" / "round_00001.safetensors"))
    assert state["personal"].shape[0] == 3  # N from the nodes' num-partitions
    assert set(summary["final-per-client-accuracy"]) == {"0", "1"}
    addressed = [
        int(m.content[P.CONFIG][P.CLIENT_ID])
        for m in grid.sent
        if m.metadata.message_type in ("train", "evaluate")
    ]
    assert sorted(set(addressed)) == [0, 1]
    assert "client-id 7 outside 0..2" in caplog.text
    # what each node reported, for reports keyed by partition (the left-out node's too)
    assert summary["client-partitions"] == {"0": 0, "1": 1, "7": 2}


def test_one_nodes_huge_num_partitions_does_not_size_pfedseqs_server(
    small_run_config: dict, caplog: pytest.LogCaptureFixture
) -> None:
    from safetensors.torch import load_file

    nodes = [{"client-id": i, "partition-id": i, "num-partitions": 3} for i in range(3)]
    nodes.append({"client-id": 3, "partition-id": 2, "num-partitions": 10**9})
    config = {**small_run_config, "method": "pfedseq", "num-clients": 0, "num-server-rounds": 1}
    summary, grid = run_in_process(config, 4, node_configs=nodes)
    run_dir = Path(config["output-dir"]) / summary["run-name"]
    state = load_file(str(run_dir / "checkpoints" / "round_00001.safetensors"))
    assert state["personal"].shape[0] == 3  # what most nodes report, not the largest claim
    assert set(summary["final-per-client-accuracy"]) == {"0", "1", "2"}
    assert "reported num-partitions 1000000000; most nodes report 3" in caplog.text
    assert "client-id 3 outside 0..2" in caplog.text


def test_pfedpg_sends_each_client_its_own_generated_prompts(small_run_config: dict) -> None:
    from safetensors.torch import load_file

    from strategies.pfedpg import PFedPGStrategy

    config = {**small_run_config, "method": "pfedpg", "num-server-rounds": 3, "pfedpg-lr": 0.05}
    summary, grid = run_in_process(config, 4)
    run_dir = Path(config["output-dir"]) / summary["run-name"]
    full = ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **config})
    strategy = PFedPGStrategy(full, initial_trainable(full, "vpt", 10))
    strategy.load_state_tensors(load_file(str(run_dir / "checkpoints" / "round_00002.safetensors")))
    round3 = [
        m for m in grid.sent if m.metadata.message_type == "train" and m.metadata.group_id == "3"
    ]
    assert len(round3) == 4
    sent = {}
    for message in round3:
        client = int(message.content[P.CONFIG][P.CLIENT_ID])
        arrays = from_array_record(message.content[P.ARRAYS])
        assert _groups(arrays, config) == {"prompt"}
        sent[client] = arrays["prompts.embeddings"]
        torch.testing.assert_close(
            sent[client], strategy.train_payload(client, 3)["prompts.embeddings"]
        )
    assert not torch.allclose(sent[0], sent[1])
