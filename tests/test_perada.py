"""PerAda (Xie et al. 2024): the client's personal and global updates against plain-torch loops,
the server's average-then-distil against a plain-torch KD loop with a hand-written Adam, the
auxiliary set, v staying on its client, the server state's resume, settings, and a run."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from safetensors.numpy import load_file

import fedfm_flower.learners.perada
from client_apps.perada import PerAdaClient
from client_apps.split import SplitClient
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data import client_sample_ids, load_public_split, public_sample_ids
from fedfm_flower.learners.perada import AuxiliarySet, auxiliary_set
from fedfm_flower.methods import ResourceProfile
from fedfm_flower.methods.perada import PerAdaSettings
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.registry import method_spec
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import numpy_arrays
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.tasks.classification import ImageClassification
from fedfm_flower.tasks.training import round_seed
from server_apps.inprocess import run_in_process
from strategies.parts.replies import ClientReply
from strategies.perada import KD_SALT, SERVER, PerAdaStrategy
from tests.tiny_clients import (
    IN,
    TWO_LAYER_NAMES,
    TwoLayerModel,
    capture_evaluated,
    client_runtime,
    data,
    offset,
    two_layer_grads,
)

NAMES = TWO_LAYER_NAMES
AUX = torch.randn(10, IN, generator=torch.Generator().manual_seed(11))  # tiny auxiliary inputs


def _client_config(**changes: object) -> ExperimentConfig:
    """Plain SGD on batches of 8 of the 22 training examples, two epochs."""
    base = {"lr": 0.3, "batch_size": 8, "momentum": 0.0, "local_epochs": 2, **changes}
    return ExperimentConfig(method="perada").replace(**base)


def _hand_personal_update(
    v: dict[str, torch.Tensor],
    anchor: dict[str, torch.Tensor],
    config: ExperimentConfig,
    seed: int,
    lam: float,
) -> dict[str, torch.Tensor]:
    """By hand: v <- v - lr (grad f(v) + lam (v - anchor)) over the round's seeded batches."""
    v = {n: t.clone() for n, t in v.items()}
    generator = torch.Generator().manual_seed(seed)
    for _ in range(config.local_epochs):
        for x, y in ImageClassification().batches(data(22, 1), config.batch_size, generator):
            grads = two_layer_grads(v, x, y)
            v = {
                n: v[n] - config.lr * (g + lam * (v[n] - anchor[n]))
                for n, g in zip(NAMES, grads, strict=True)
            }
    return v


def _two_layer_logits(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """head(tanh(body(x))) written out."""
    hidden = torch.tanh(x @ params["body.weight"].T + params["body.bias"])
    return hidden @ params["head.weight"].T + params["head.bias"]


def _hand_distillation(
    start: dict[str, torch.Tensor],
    teachers: list[dict[str, torch.Tensor]],
    settings: PerAdaSettings,
    seed: int,
) -> dict[str, torch.Tensor]:
    """By hand in plain torch: the batches (seeded random passes over AUX), the teacher as the
    mean of the teachers' logits, KL(p_teacher || p_student) at temperature T averaged over
    rows, and Adam (beta 0.9, 0.999, eps 1e-8) with a cosine-annealed step size."""
    steps, size, batch = settings.kd_steps, len(AUX), settings.kd_batch_size
    generator = torch.Generator().manual_seed(seed)
    batches: list[torch.Tensor] = []
    while len(batches) < steps:
        order = torch.randperm(size, generator=generator)
        batches += [order[i : i + batch] for i in range(0, size, batch)]
    w = {n: t.clone() for n, t in start.items()}
    m = {n: torch.zeros_like(t) for n, t in w.items()}
    s = {n: torch.zeros_like(t) for n, t in w.items()}
    temperature = settings.kd_temperature
    for k, rows in enumerate(batches[:steps]):
        x = AUX[rows]
        teacher = sum(_two_layer_logits(t, x) for t in teachers) / len(teachers)
        leaves = {n: t.clone().requires_grad_() for n, t in w.items()}
        p_t = torch.softmax(teacher / temperature, dim=1)
        log_s = torch.log_softmax(_two_layer_logits(leaves, x) / temperature, dim=1)
        kl = (p_t * (torch.log(p_t) - log_s)).sum(1).mean()
        grads = dict(zip(NAMES, torch.autograd.grad(kl, [leaves[n] for n in NAMES]), strict=True))
        lr = settings.kd_lr * 0.5 * (1 + math.cos(math.pi * k / steps))
        for n in NAMES:
            m[n] = 0.9 * m[n] + 0.1 * grads[n]
            s[n] = 0.999 * s[n] + 0.001 * grads[n] ** 2
            m_hat, s_hat = m[n] / (1 - 0.9 ** (k + 1)), s[n] / (1 - 0.999 ** (k + 1))
            w[n] = w[n] - lr * m_hat / (s_hat.sqrt() + 1e-8)
    return w


class TinyPerAda(PerAdaStrategy):
    """PerAda's server on the two-layer model with the tiny auxiliary inputs."""

    def auxiliary_set(self) -> AuxiliarySet:
        return AuxiliarySet(len(AUX), lambda rows: AUX[rows])

    def distillation_model(self) -> TwoLayerModel:
        return TwoLayerModel()


def _server_config(**changes: object) -> ExperimentConfig:
    """5 KD steps of 4 of the 10 auxiliary inputs (passes of 4, 4, 2: the second pass starts
    within the round), T = 2."""
    base = {
        "seed": 3,
        "perada_kd_steps": 5,
        "perada_kd_batch_size": 4,
        "perada_kd_lr": 0.05,
        "perada_kd_temperature": 2.0,
        **changes,
    }
    return ExperimentConfig(method="perada").replace(**base)


def _replies(initial: dict[str, torch.Tensor], seed: int) -> list[ClientReply]:
    """Three clients' returned models, 5, 9 and 14 examples."""
    return [
        ClientReply(c, 100 + c, offset(initial, seed + c, 0.5), n, {})
        for c, n in zip((0, 1, 2), (5, 9, 14), strict=True)
    ]


def _fedavg(replies: list[ClientReply]) -> dict[str, torch.Tensor]:
    """The example-weighted average, in float64."""
    total = sum(r.num_examples for r in replies)
    return {
        n: (sum(r.num_examples * r.arrays[n].double() for r in replies) / total).float()
        for n in NAMES
    }


# ----------------------------------------------------------------------------- the client


def test_the_personal_update_matches_a_plain_torch_loop(tmp_path: Path) -> None:
    lam = 0.7
    config = _client_config(perada_lambda=lam)
    model = TwoLayerModel()
    runtime = client_runtime(model, config, tmp_path / "state")
    initial = model.trainable().tensors
    received = offset(initial, 1, 0.2)  # w^t of round 2
    start = offset(initial, 2, 0.5)  # v after round 1
    runtime.store.save(1, start)
    kept = {n: t.clone() for n, t in received.items()}
    sent, stats = PerAdaClient().train(runtime, received, 2)
    v = runtime.store.load(before=3)
    expected = _hand_personal_update(start, kept, config, runtime.seed(2), lam)
    assert all(torch.allclose(v[n], expected[n], atol=1e-6) for n in NAMES)
    # lambda is PerAda's key (not Ditto's): without the pull the result is visibly different.
    plain = _hand_personal_update(start, kept, config, runtime.seed(2), 0.0)
    assert (v["head.weight"] - plain["head.weight"]).abs().max() > 1e-3
    assert stats.num_steps == 12  # w's 6 batches, then v's 6


def test_the_global_update_is_fedavgs_and_v_stays_on_the_client(tmp_path: Path) -> None:
    config = _client_config(perada_lambda=1.0)
    sent = {}
    for name, client in (("fedavg", SplitClient()), ("perada", PerAdaClient())):
        model = TwoLayerModel()
        runtime = client_runtime(model, config, tmp_path / name)
        received = offset(model.trainable().tensors, 3, 0.1)
        sent[name], _ = client.train(runtime, received, 1)
    assert list(sent["perada"]) == list(NAMES)
    assert all(torch.equal(sent["perada"][n], sent["fedavg"][n]) for n in NAMES)
    # v is kept (on disk too), is not what was sent, and is what a restarted client evaluates.
    v = runtime.store.load(before=2)
    assert not any(torch.equal(v[n], sent["perada"][n]) for n in NAMES)
    restarted = client_runtime(TwoLayerModel(), config, tmp_path / "perada", state=RecordDict())
    evaluated = capture_evaluated(restarted)
    PerAdaClient().evaluate(restarted, offset(received, 4, 5.0), 1)
    assert all(torch.equal(evaluated[n], v[n]) for n in NAMES)


# ----------------------------------------------------------------------------- the server


def test_the_server_averages_then_distils_as_a_plain_torch_kd_loop() -> None:
    config = _server_config()
    initial = TwoLayerModel().trainable()
    strategy = TinyPerAda(config, initial)
    replies = _replies(initial.tensors, 20)
    metrics = strategy.aggregate(1, replies)
    settings = config.settings_of(PerAdaSettings)
    seed = round_seed(3, SERVER, 1, KD_SALT)
    teachers = [r.arrays for r in replies]
    average = _fedavg(replies)
    expected = _hand_distillation(average, teachers, settings, seed)
    for n in NAMES:
        assert torch.allclose(strategy.global_tensors[n], expected[n], atol=1e-5), n
    assert (strategy.global_tensors["head.weight"] - average["head.weight"]).abs().max() > 1e-2
    # The teacher is the mean of the logits, not of the tensors: distilling from the averaged
    # model alone gives another result.
    alone = _hand_distillation(average, [average], settings, seed)
    assert (alone["head.weight"] - expected["head.weight"]).abs().max() > 1e-3
    assert metrics["perada-kd-teachers"] == 3.0 and metrics["perada-kd-rows"] == 10.0


def test_no_distillation_leaves_fedavgs_average() -> None:
    initial = TwoLayerModel().trainable()
    replies = _replies(initial.tensors, 30)
    average = _fedavg(replies)
    for changes, server_round in (({"perada_kd_steps": 0}, 1), ({"perada_kd_rounds": 2}, 3)):
        strategy = TinyPerAda(_server_config(**changes), initial)
        metrics = strategy.aggregate(server_round, replies)
        assert all(torch.allclose(strategy.global_tensors[n], average[n]) for n in NAMES)
        assert not any(k.startswith("perada-kd") for k in metrics)
    strategy = TinyPerAda(_server_config(perada_kd_rounds=2), initial)
    strategy.aggregate(2, replies)  # round 2 of 2 still distils
    assert (strategy.global_tensors["head.weight"] - average["head.weight"]).abs().max() > 1e-2


def test_the_server_state_is_the_global_adapter_and_resumes_exactly() -> None:
    config = _server_config()
    initial = TwoLayerModel().trainable()
    straight = TinyPerAda(config, initial)
    straight.aggregate(1, _replies(initial.tensors, 40))
    tensors, meta = straight.state_dict()
    assert set(tensors) == {f"global.{n}" for n in NAMES}  # no client's personal adapter
    straight.aggregate(2, _replies(initial.tensors, 50))
    resumed = TinyPerAda(config, initial)
    resumed.load_state_dict(tensors, meta)
    resumed.aggregate(2, _replies(initial.tensors, 50))
    assert all(torch.equal(resumed.global_tensors[n], straight.global_tensors[n]) for n in NAMES)


# ----------------------------------------------------------------------------- auxiliary data


def test_the_public_auxiliary_set_is_no_clients_data(cache_dir: Path) -> None:
    config = ExperimentConfig(method="perada").replace(cache_dir=str(cache_dir), num_clients=4)
    aux = auxiliary_set(config)
    train, test = public_sample_ids(config)
    assert aux.size == len(train) + len(test) > 0
    held = set()
    for client in range(4):
        ids = client_sample_ids(config, client, 4)
        held |= set(ids.train) | set(ids.test) | set(ids.val)
    assert held.isdisjoint(set(train) | set(test))
    # Its inputs are the public split's images, normalized as the clients' inputs.
    public_train, public_test, _ = load_public_split(config)
    images = torch.cat([public_train.tensors[0], public_test.tensors[0]])
    order = np.argsort(np.concatenate([train, test]), kind="stable")
    rows = torch.tensor([0, 5, aux.size - 1])
    assert torch.allclose(aux.inputs(rows), images[torch.from_numpy(order)][rows])
    empty = config.replace(public_fraction=0.0001)
    with pytest.raises(ConfigError, match="perada-aux-data"):
        PerAdaStrategy(empty, TwoLayerModel().trainable())


def test_the_glyphs_auxiliary_set_is_glyph_domains_public_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[ExperimentConfig] = []

    def public_ids(config: ExperimentConfig) -> tuple[np.ndarray, np.ndarray]:
        asked.append(config)
        return np.array([7, 2]), np.array([4])

    class Source:
        def images(self, ids: np.ndarray) -> torch.Tensor:
            return torch.tensor(ids, dtype=torch.float32)[:, None].repeat(1, 2)

    settings_seen = []
    monkeypatch.setattr(fedfm_flower.learners.perada, "public_sample_ids", public_ids)
    monkeypatch.setattr(
        fedfm_flower.learners.perada, "load_source", lambda s: settings_seen.append(s) or Source()
    )
    config = ExperimentConfig(method="perada").replace(
        dataset="digits-domains", partitioner="iid", perada_aux_data="glyphs"
    )
    aux = auxiliary_set(config)
    assert [c.dataset for c in asked] == ["glyph-domains"] and asked[0].data_dir == ""
    assert settings_seen[0].dataset == "glyph-domains"
    assert aux.size == 3
    # Sorted sample ids 2, 4, 7; pixels in [0, 1] mapped to the model range (x - 0.5) / 0.5.
    assert torch.equal(aux.inputs(torch.tensor([0, 2])), torch.tensor([[3.0, 3.0], [13.0, 13.0]]))


def test_the_cifar10_auxiliary_set_is_every_image_of_a_local_copy(tmp_path: Path) -> None:
    """``perada-aux-data = cifar10`` reads all of a local CIFAR-10 copy (train, then test),
    resized to the run's image size and normalized as the clients' inputs; refused on a
    CIFAR-10 run and for a missing directory."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (12, 9, 3), dtype=np.uint8)) for _ in range(7)]
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=[f"c{i}" for i in range(10)])}
    )
    splits = {"train": pictures[:5], "test": pictures[5:]}
    datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict(
                {"img": images, "label": [i % 10 for i in range(len(images))]}, features=features
            )
            for name, images in splits.items()
        }
    ).save_to_disk(tmp_path / "cifar10")
    config = ExperimentConfig(method="perada").replace(
        image_size=16, perada_aux_data="cifar10", perada_aux_dir=str(tmp_path / "cifar10")
    )
    aux = auxiliary_set(config)
    assert aux.size == 7
    want = torch.stack(
        [
            torch.from_numpy(np.array(p.resize((16, 16), Image.Resampling.BILINEAR)))
            .permute(2, 0, 1)
            .float()
            / 255.0
            for p in pictures
        ]
    )
    rows = torch.tensor([6, 0, 3])
    torch.testing.assert_close(aux.inputs(rows), (want[rows] - 0.5) / 0.5)
    with pytest.raises(ConfigError, match="'perada-aux-data' = 'cifar10'.*clients hold"):
        auxiliary_set(config.replace(dataset="cifar10", data_dir=str(tmp_path / "cifar10")))
    with pytest.raises(ConfigError, match="'perada-aux-dir' = .*no such directory"):
        auxiliary_set(config.replace(perada_aux_dir=str(tmp_path / "absent")))
    with pytest.raises(ConfigError, match="'perada-aux-dir' = .*only with perada-aux-data"):
        config.replace(perada_aux_data="public")


# ----------------------------------------------------------------------------- settings


def test_settings_defaults_rules_capabilities_and_spec() -> None:
    settings = PerAdaSettings()
    assert (settings.lambda_, settings.kd_steps, settings.kd_lr) == (0.1, 100, 0.005)
    assert (settings.kd_batch_size, settings.kd_temperature, settings.aux_data) == (
        128,
        1.0,
        "public",
    )
    assert settings.distils(1) and not settings.replace(kd_steps=0).distils(1)
    assert settings.replace(kd_rounds=30).distils(30)
    assert not settings.replace(kd_rounds=30).distils(31)
    for key, value in (
        ("perada-lambda", -1.0),
        ("perada-kd-lr", 0.0),
        ("perada-kd-batch-size", 0),
        ("perada-aux-data", "cifar-10"),
    ):
        with pytest.raises(ConfigError, match=f"'{key}' = {value!r}"):
            ExperimentConfig.from_run_config({"method": "perada", key: value})
    for key, value in (("secagg", True), ("dp", "central")):
        with pytest.raises(ConfigError, match=f"'{key}'.*perada"):
            ExperimentConfig.from_run_config({"method": "perada", key: value})
    ExperimentConfig.from_run_config({"method": "perada", "dp": "local"})  # post-processing
    spec = method_spec("perada")
    assert spec.strategy == "strategies.perada:PerAdaStrategy" and spec.tuner == "lora"
    assert spec.profile == ResourceProfile(copies=2, passes=2)
    assert spec.search == {  # pFedSeq's grids' ends
        "perada-lambda": LogUniform(0.01, 10.0),
        "perada-kd-lr": LogUniform(0.001, 0.05),
    }


# ----------------------------------------------------------------------------- end to end


def test_a_run_distils_each_round_and_keeps_the_personal_adapters_home(
    small_run_config: dict, tmp_path: Path
) -> None:
    replies: list[tuple[int, dict]] = []

    def keep(client_id: int, reply, replies=replies):  # noqa: ANN001, ANN202
        if reply.metadata.message_type == "train" and P.ARRAYS in reply.content.array_records:
            replies.append((client_id, numpy_arrays(reply.content.array_records[P.ARRAYS])))
        return reply

    config = {
        **small_run_config,
        "method": "perada",
        "perada-kd-steps": 3,
        "perada-kd-batch-size": 32,
        "run-name": "perada",
        "client-state-dir": str(tmp_path / "state"),
    }
    summary, grid = run_in_process(config, num_nodes=4, reply_hook=keep)
    assert summary["rounds"] == 2 and 0.2 < summary["final-test-accuracy-mean"] <= 1.0
    records = RunDirectory(Path(config["output-dir"]) / summary["run-name"]).rounds()
    assert [r["server"]["perada-kd-teachers"] for r in records] == [4.0, 4.0]
    assert all(r["server"]["perada-kd-rows"] == 96.0 for r in records)  # 3 steps of 32
    # Each client's personal adapter is on its disk and in no message, up or down.
    down = [
        numpy_arrays(m.content.array_records[P.ARRAYS])
        for m in grid.sent
        if P.ARRAYS in m.content.array_records
    ]
    assert len(replies) == 8
    for client in range(4):
        path = tmp_path / "state" / "perada" / f"client_{client}" / "round_00002.safetensors"
        v = load_file(str(path))
        for arrays in down + [a for _, a in replies]:
            shared = [n for n in v if n in arrays]
            assert shared and not all(np.array_equal(arrays[n], v[n]) for n in shared)
