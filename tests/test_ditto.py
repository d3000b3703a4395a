"""Ditto (Li et al. 2021): the personal update against a plain-torch loop, the global update
against FedAvg's bit for bit, lambda's two ends, v's state, and a run end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client_apps.ditto import DittoClient
from client_apps.split import SplitClient
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods import AVERAGE_ONLY, ResourceProfile
from fedfm_flower.methods.ditto import DittoSettings
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.registry import method_spec
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import numpy_arrays
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.tasks.classification import ImageClassification
from server_apps.inprocess import run_in_process
from tests.tiny_clients import (
    TWO_LAYER_NAMES,
    TwoLayerModel,
    client_runtime,
    data,
    kept_personal_model,
    offset,
    two_layer_grads,
)

NAMES = TWO_LAYER_NAMES


def _config(method: str = "ditto", **changes: object) -> ExperimentConfig:
    """Plain SGD (the paper's step) on batches of 8 of the 22 training examples."""
    base = {"lr": 0.3, "batch_size": 8, "momentum": 0.0, "local_epochs": 2, **changes}
    return ExperimentConfig(method=method).replace(**base)


def _saved_v(runtime, start: dict[str, torch.Tensor]) -> None:
    """Make ``start`` the client's v after round 1."""
    runtime.store.save(1, start)


def _hand_personal_update(
    v: dict[str, torch.Tensor],
    anchor: dict[str, torch.Tensor],
    config: ExperimentConfig,
    seed: int,
    lam: float,
) -> dict[str, torch.Tensor]:
    """By hand in plain torch: v <- v - lr (grad f(v) + lam (v - anchor)) over the batches of
    the round's seeded order (epochs passes of the 22 examples)."""
    examples = data(22, 1)  # the train split of ``client_runtime``
    v = {n: t.clone() for n, t in v.items()}
    generator = torch.Generator().manual_seed(seed)
    for _ in range(config.local_epochs):
        for x, y in ImageClassification().batches(examples, config.batch_size, generator):
            grads = two_layer_grads(v, x, y)
            v = {
                n: v[n] - config.lr * (g + lam * (v[n] - anchor[n]))
                for n, g in zip(NAMES, grads, strict=True)
            }
    return v


# ----------------------------------------------------------------------------- the client


def test_the_personal_update_matches_a_plain_torch_loop(tmp_path: Path) -> None:
    lam = 0.7
    config = _config(ditto_lambda=lam)
    model = TwoLayerModel()
    runtime = client_runtime(model, config, tmp_path / "state")
    initial = model.trainable().tensors
    received = offset(initial, 1, 0.2)  # w^t of round 2
    start = offset(initial, 2, 0.5)  # v after round 1, away from w^t
    _saved_v(runtime, start)
    kept = {n: t.clone() for n, t in received.items()}
    sent, stats = DittoClient().train(runtime, received, 2)
    v = runtime.store.load(before=3)
    assert v is not None and set(v) == set(NAMES)
    expected = _hand_personal_update(start, kept, config, runtime.seed(2), lam)
    for name in NAMES:
        assert torch.allclose(v[name], expected[name], atol=1e-6), name
    # Without the pull (or anchored at the locally updated w) the result is visibly different.
    plain = _hand_personal_update(start, kept, config, runtime.seed(2), 0.0)
    towards_sent = _hand_personal_update(start, sent, config, runtime.seed(2), lam)
    assert (v["head.weight"] - plain["head.weight"]).abs().max() > 1e-3
    assert (v["head.weight"] - towards_sent["head.weight"]).abs().max() > 1e-3
    assert all(torch.equal(received[n], kept[n]) for n in NAMES)  # the anchor is untouched
    assert stats.num_steps == 12 and stats.examples_seen == 88  # w's 6 batches, then v's 6


def test_the_global_update_is_fedavgs_bit_for_bit(tmp_path: Path) -> None:
    sent = {}
    for method in ("fedavg", "ditto"):
        config = ExperimentConfig(method=method).replace(lr=0.1, batch_size=4, ditto_lambda=1.0)
        model = TwoLayerModel()
        runtime = client_runtime(model, config, tmp_path / method)
        received = offset(model.trainable().tensors, 3, 0.1)
        client = SplitClient() if method == "fedavg" else DittoClient()
        sent[method], _ = client.train(runtime, received, 1)
    assert list(sent["ditto"]) == list(sent["fedavg"]) == list(NAMES)  # w only, never v
    assert all(torch.equal(sent["ditto"][n], sent["fedavg"][n]) for n in NAMES)


def test_lambda_zero_is_plain_local_training_and_a_large_lambda_pulls_v_to_w(
    tmp_path: Path,
) -> None:
    model = TwoLayerModel()
    initial = model.trainable().tensors
    received = offset(initial, 4, 0.2)
    start = offset(initial, 5, 1.0)

    def personal(lam: float, **changes: object) -> dict[str, torch.Tensor]:
        config = _config(ditto_lambda=lam, **changes)
        runtime = client_runtime(model, config, tmp_path / f"{lam}-{len(changes)}")
        _saved_v(runtime, start)
        DittoClient().train(runtime, received, 2)
        return runtime.store.load(before=3)

    # lambda = 0: v is plain local training of v (the run's loop, no penalty), bit for bit.
    runtime = client_runtime(model, _config(method="fedavg"), tmp_path / "plain")
    local = runtime.model()
    local.load_tensors(start)
    runtime.train(local, NAMES, runtime.seed(2))
    v = personal(0.0)
    assert all(torch.equal(v[n], local.get_parameter(n).detach()) for n in NAMES)

    def distance(v: dict[str, torch.Tensor]) -> float:
        return sum(((v[n] - received[n]) ** 2).sum() for n in NAMES).sqrt().item()

    # The pull grows with lambda (lr lambda <= 1, the stable steps of plain SGD).
    distances = [distance(personal(lam)) for lam in (0.0, 0.3, 1.0, 3.0)]
    assert distances == sorted(distances, reverse=True) and distances[-1] < 0.2 * distances[0]
    # lambda = 1 / lr: one step lands on w^t minus a plain gradient step taken at v's start.
    config = _config(ditto_lambda=1 / 0.3, ditto_personal_steps=1)
    one_step = personal(1 / 0.3, ditto_personal_steps=1)
    runtime = client_runtime(model, config, tmp_path / "step")
    generator = torch.Generator().manual_seed(runtime.seed(2))
    x, y = next(ImageClassification().batches(runtime.data.train, 8, generator))
    for name, g in zip(NAMES, two_layer_grads(start, x, y), strict=True):
        assert torch.allclose(one_step[name], received[name] - 0.3 * g, atol=1e-6), name


def test_v_is_kept_restored_after_a_restart_and_evaluated_alone(tmp_path: Path) -> None:
    config = _config(ditto_lambda=0.1)
    _, _, sent, v, restarted = kept_personal_model(DittoClient, config, tmp_path / "state")
    # Round 2 starts from that v: its update equals the hand loop started there.
    DittoClient().train(restarted, sent, 2)
    expected = _hand_personal_update(v, sent, config, restarted.seed(2), 0.1)
    v2 = restarted.store.load(before=3)
    assert all(torch.allclose(v2[n], expected[n], atol=1e-6) for n in NAMES)


def test_settings_defaults_rules_and_spec() -> None:
    settings = DittoSettings()
    assert (settings.lambda_, settings.personal_lr) == (0.1, 0.0)
    assert DittoSettings.keys() == (
        "ditto-lambda",
        "ditto-personal-epochs",
        "ditto-personal-steps",
        "ditto-personal-lr",
    )
    assert settings.schedule(3, 0) == (3, 0) and settings.schedule(1, 5) == (1, 5)
    assert settings.replace(personal_epochs=2).schedule(3, 5) == (2, 0)
    assert settings.replace(personal_epochs=2, personal_steps=4).schedule(3, 0) == (0, 4)
    assert settings.personal_step(0.02) == 0.02
    assert settings.replace(personal_lr=0.5).personal_step(0.02) == 0.5
    with pytest.raises(ConfigError, match="ditto-lambda"):
        ExperimentConfig.from_run_config({"method": "ditto", "ditto-lambda": -1.0})
    config = ExperimentConfig.from_run_config({"method": "ditto", "ditto-lambda": "2"})
    assert config.method_settings == DittoSettings(lambda_=2.0)
    spec = method_spec("ditto")
    assert spec.strategy == "strategies.fedavg:FedAvgStrategy" and spec.tuner == "lora"
    assert spec.capabilities == AVERAGE_ONLY
    assert spec.profile == ResourceProfile(copies=2, passes=2)
    assert spec.search == {"ditto-lambda": LogUniform(0.01, 10.0)}  # pFedSeq's grid ends


def test_a_personal_lr_and_schedule_of_their_own(tmp_path: Path) -> None:
    model = TwoLayerModel()
    initial = model.trainable().tensors
    received = offset(initial, 8, 0.2)
    config = _config(ditto_lambda=0.5, ditto_personal_lr=0.05, ditto_personal_epochs=1)
    runtime = client_runtime(model, config, tmp_path)
    _, stats = DittoClient().train(runtime, received, 1)
    assert stats.num_steps == 6 + 3  # w: local-epochs 2; v: one epoch
    v = runtime.store.load(before=2)
    expected = _hand_personal_update(
        initial, received, _config(lr=0.05, local_epochs=1), runtime.seed(1), 0.5
    )
    assert all(torch.allclose(v[n], expected[n], atol=1e-6) for n in NAMES)


# ----------------------------------------------------------------------------- end to end


def test_a_run_sends_fedavgs_global_models_and_evaluates_the_personal_ones(
    small_run_config: dict, tmp_path: Path
) -> None:
    runs = {}
    for method in ("fedavg", "ditto"):
        replies: list[tuple[int, dict]] = []

        def keep(client_id: int, reply, replies=replies):  # noqa: ANN001, ANN202
            if reply.metadata.message_type == "train" and P.ARRAYS in reply.content.array_records:
                replies.append((client_id, numpy_arrays(reply.content.array_records[P.ARRAYS])))
            return reply

        config = {
            **small_run_config,
            "method": method,
            "ditto-lambda": 0.1,
            "run-name": method,
            "client-state-dir": str(tmp_path / "state" / method),
        }
        summary, grid = run_in_process(config, num_nodes=4, reply_hook=keep)
        sent = [
            numpy_arrays(m.content.array_records[P.ARRAYS])
            for m in grid.sent
            if m.metadata.message_type == "train"
        ]
        records = RunDirectory(Path(config["output-dir"]) / summary["run-name"]).rounds()
        runs[method] = (summary, sent, replies, records)
    (_, avg_sent, avg_replies, avg_records) = runs["fedavg"]
    (summary, ditto_sent, ditto_replies, ditto_records) = runs["ditto"]
    assert summary["rounds"] == 2 and set(summary["final-per-client-accuracy"]) == {
        "0",
        "1",
        "2",
        "3",
    }
    assert 0.2 < summary["final-test-accuracy-mean"] <= 1.0  # chance is 0.1
    # The global models (down) and every client's w (up) are FedAvg's, bit for bit.
    assert len(ditto_sent) == len(avg_sent) > 0 and len(ditto_replies) == len(avg_replies) == 8
    for ours, theirs in zip(ditto_sent, avg_sent, strict=True):
        assert ours.keys() == theirs.keys() and all((ours[n] == theirs[n]).all() for n in ours)
    for (c1, ours), (c2, theirs) in zip(
        sorted(ditto_replies, key=lambda r: r[0]),
        sorted(avg_replies, key=lambda r: r[0]),
        strict=True,
    ):
        assert c1 == c2 and all((ours[n] == theirs[n]).all() for n in ours)
    # What is evaluated is each client's own v, not the global model.
    assert [r["evaluate"] for r in ditto_records] != [r["evaluate"] for r in avg_records]
    clients = sorted((tmp_path / "state" / "ditto" / "ditto").iterdir())
    assert [c.name for c in clients] == [f"client_{i}" for i in range(4)]
    assert all((c / "round_00002.safetensors").is_file() for c in clients)
