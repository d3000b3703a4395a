"""TAP: the replacement rule (eq. 3-4) on hand-made losses, the KD loss (eq. 5) against a hand
computation, and the method end to end on the multi-task federation (X never travels and
survives a restart; the post-FL round runs once, after the last round)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import record_names


def test_eq3_replaces_where_the_federated_loss_beats_the_personal_by_the_margin() -> None:
    from client_apps.tap import replacement

    margins = {"image-cls": 0.01, "text-gen": 0.01, "vqa": 0.01}
    trained = {"image-cls": 0.50, "text-gen": 0.50, "vqa": 0.40}
    personal = {"image-cls": 0.515, "text-gen": 0.505}  # vqa: X has not trained on it yet
    assert replacement(trained, personal, margins) == {
        "image-cls": True,  # 0.50 + 0.01 < 0.515
        "text-gen": False,  # 0.50 + 0.01 >= 0.505: within the margin, X is kept
        "vqa": True,  # no h^(p) yet: +inf
    }
    assert replacement({}, personal, margins) == {}  # pairs not seen this round: no decision


USERS = {
    "mote.vqa.attn": frozenset({"vqa"}),
    "mote.text-gen.attn": frozenset({"text-gen"}),
    "mote.image-cls.attn": frozenset({"image-cls"}),
    "decoder.text-generation": frozenset({"vqa", "text-gen"}),
    "encoder.image": frozenset({"vqa", "image-cls", "image-gen"}),
    "mome.shared": frozenset({"vqa", "image-cls", "image-gen", "text-cls", "text-gen"}),
}


def test_eq4_paper_rule_copies_every_part_of_a_pair_that_asks_shared_ones_included() -> None:
    from client_apps.tap import replaced_components

    holds = ("vqa", "text-gen")
    only_vqa = replaced_components(USERS, holds, {"vqa": True, "text-gen": False})
    # X_[i,vqa] := W~_[i,vqa]: everything vqa uses moves, the decoder and mome it shares too.
    assert only_vqa == {"mote.vqa.attn", "decoder.text-generation", "encoder.image", "mome.shared"}
    assert replaced_components(USERS, holds, {"vqa": True}) == only_vqa  # text-gen unseen
    assert replaced_components(USERS, holds, {"vqa": False, "text-gen": False}) == set()
    assert replaced_components(USERS, holds, {"vqa": True, "text-gen": True}) == {
        "mote.vqa.attn",
        "mote.text-gen.attn",
        "decoder.text-generation",
        "encoder.image",
        "mome.shared",
    }  # never a component of a pair the client does not hold


def test_eq4_all_pairs_rule_moves_a_component_only_when_all_of_its_users_here_ask() -> None:
    from client_apps.tap import replaced_components

    holds = ("vqa", "text-gen")
    only_vqa = replaced_components(USERS, holds, {"vqa": True, "text-gen": False}, "all-pairs")
    assert only_vqa == {"mote.vqa.attn", "encoder.image"}  # image encoder: vqa its only user here
    both = replaced_components(USERS, holds, {"vqa": True, "text-gen": True}, "all-pairs")
    assert both == {
        "mote.vqa.attn",
        "mote.text-gen.attn",
        "decoder.text-generation",
        "encoder.image",
        "mome.shared",
    }
    assert replaced_components(USERS, holds, {"vqa": True}, "all-pairs") == only_vqa


def test_eq4_rules_against_the_union_of_the_asking_pairs_parts_for_every_assignment() -> None:
    """Over all 8 assignments of R for a 3-pair client: ``paper`` is the union over pairs with
    R = 1 of the parts that serve them (eq. 4 applied pair by pair, as the authors' loop does);
    ``all-pairs`` is a subset of it, and the two differ in most assignments."""
    import itertools

    from client_apps.tap import replaced_components

    holds = ("vqa", "image-cls", "text-gen")
    differ = 0
    for flags in itertools.product([False, True], repeat=3):
        replace = dict(zip(holds, flags, strict=True))
        by_pair = set()
        for pair, asks in replace.items():
            if asks:
                by_pair |= {g for g, serves in USERS.items() if pair in serves}
        paper = replaced_components(USERS, holds, replace, "paper")
        strict = replaced_components(USERS, holds, replace, "all-pairs")
        assert paper == by_pair
        assert strict <= paper
        differ += strict != paper
    assert differ == 6  # all but none-ask and all-ask
    with pytest.raises(ValueError, match="'some'"):
        replaced_components(USERS, holds, {}, "some")


def test_eq5_kd_is_the_softened_kl_for_classes_tokens_and_mse_for_images() -> None:
    from fedfm_flower.tasks.distillation import distillation_loss, softened_kl
    from fedfm_flower.tasks.multitask import TaskOutput

    rng = np.random.default_rng(0)
    teacher, student = rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
    tau = 2.0

    def softmax(z: np.ndarray) -> np.ndarray:
        e = np.exp(z / tau - (z / tau).max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(teacher), softmax(student)
    expected = np.mean(np.sum(p * (np.log(p) - np.log(q)), axis=-1))
    got = softened_kl(torch.tensor(teacher), torch.tensor(student), tau)
    assert got.item() == pytest.approx(expected, rel=1e-9)
    rows = torch.arange(4)
    cls = distillation_loss(
        TaskOutput("image-cls", rows, torch.tensor(student), rows, torch.tensor(0.0)),
        TaskOutput("image-cls", rows, torch.tensor(teacher), rows, torch.tensor(0.0)),
        tau,
    )
    assert cls.item() == pytest.approx(expected, rel=1e-9)
    # Text: only the scored positions count, each a distribution over the vocabulary.
    t_tok, s_tok = rng.normal(size=(2, 3, 6)), rng.normal(size=(2, 3, 6))
    scored = torch.tensor([[True, True, False], [True, False, False]])
    pick = scored.numpy()
    p, q = softmax(t_tok[pick]), softmax(s_tok[pick])
    expected = np.mean(np.sum(p * (np.log(p) - np.log(q)), axis=-1))
    rows = torch.arange(2)
    text = distillation_loss(
        TaskOutput("text-gen", rows, torch.tensor(s_tok), rows, torch.tensor(0.0), scored),
        TaskOutput("text-gen", rows, torch.tensor(t_tok), rows, torch.tensor(0.0), scored),
        tau,
    )
    assert text.item() == pytest.approx(expected, rel=1e-9)
    a, b = torch.rand(2, 3, 8, 8), torch.rand(2, 3, 8, 8)
    image = distillation_loss(
        TaskOutput("image-gen", rows, a, a, torch.tensor(0.0)),
        TaskOutput("image-gen", rows, b, b, torch.tensor(0.0)),
        tau,
    )
    assert image.item() == pytest.approx(((a - b) ** 2).mean().item(), rel=1e-6)
    assert not math.isnan(image.item())


@pytest.fixture
def tap_config(multitask_run_config: dict) -> dict:
    """TAP on the small multi-task federation, P = 2."""
    return {**multitask_run_config, "method": "tap", "tap-distill-steps": 2}


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tap_end_to_end_x_stays_home_and_survives_a_restart(tap_config: dict) -> None:
    from safetensors.torch import load_file

    from fedfm_flower.records.messages import from_array_record
    from server_apps.inprocess import ServerCrash, crash_in_round, run_in_process

    replies = []

    def keep(client_id, reply):  # noqa: ANN001, ANN202
        replies.append((client_id, reply))
        return reply

    full, grid = run_in_process({**tap_config, "run-name": "whole"}, 4, keep)
    run_dir = Path(tap_config["output-dir"]) / "whole"
    records = _records(run_dir)
    assert [(r["round"], r["phase"]) for r in records] == [
        (1, "train"),
        (2, "train"),
        (3, "post-training"),
    ]
    assert records[2]["bytes-up-train"] == 0 and records[2]["clients-sampled"] == 4
    assert (run_dir / "checkpoints" / "round_00003.safetensors").is_file()
    # The card names both builds mm-offline is made of, each by its weights' digest.
    saved = json.loads((run_dir / "config.json").read_text())
    card, cache = saved["foundation"], Path(saved["run-config"]["cache-dir"])
    assert set(card["parts"]) == {"image", "text"}
    for part in card["parts"].values():
        weights = cache / part["cache-files"][0]
        assert part["weights-sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert card["key"] == f"{card['parts']['image']['key']}+{card['parts']['text']['key']}"
    # Round 1: X has no history, so every pair a client trained is replaced (eq. 3, +inf).
    for client, metrics in records[0]["train"].items():
        flags = {k: v for k, v in metrics.items() if k.startswith("train-replaced-")}
        assert flags and all(v == 1.0 for v in flags.values()), client
    # What a client sent is its W~, never its X: compare with the X it kept after round 2.
    state = Path(tap_config["client-state-dir"]) / "whole"
    sent = {}  # the last non-empty training reply of each client: round 2's W~
    for client, reply in replies:
        arrays = reply.content.array_records.get(P.ARRAYS)
        if arrays is not None and record_names(arrays):
            sent[client] = from_array_record(arrays)
    assert set(sent) == {0, 1, 2, 3}
    for client, w in sent.items():
        kept = load_file(state / f"client_{client}" / "round_00002.safetensors")
        x = {k: v for k, v in kept.items() if not k.startswith("tap.history.")}
        assert set(x) == set(w)  # the same components, but X's values are not W~'s
        assert any(not torch.equal(x[n], w[n]) for n in x)
        assert any(k.startswith("tap.history.") for k in kept)
    # A restart (fresh contexts) reloads X and the histories from disk: same final metrics.
    with pytest.raises(ServerCrash):
        run_in_process({**tap_config, "run-name": "crashed"}, 4, crash_in_round(3))
    resumed, _ = run_in_process({**tap_config, "run-name": "crashed", "resume": True}, 4)
    assert resumed["final-per-client-task-score"] == full["final-per-client-task-score"]


# fedavg: tests/test_multimodal_model.py
@pytest.mark.parametrize("method", ["local", "fedavg-ft", "per-fedavg", "per-fedavg-ft"])
def test_each_tap_baseline_runs_and_sends_only_its_clients_components(
    method: str, tap_config: dict
) -> None:
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.data.multitask import client_tasks
    from fedfm_flower.methods.registry import trains_backbone, tuner_of
    from fedfm_flower.models.build import initial_trainable
    from fedfm_flower.records.messages import from_array_record
    from server_apps.inprocess import run_in_process

    replies = []

    def keep(client_id, reply):  # noqa: ANN001, ANN202
        replies.append((client_id, reply))
        return reply

    config = {**tap_config, "method": method, "num-server-rounds": 1, "finetune-steps": 1}
    summary, _ = run_in_process(config, 4, keep)
    assert summary["rounds"] == 1
    scores = summary["final-per-client-task-score"]
    assert set(scores) == {"0", "1", "2", "3"} and all(not math.isnan(s) for s in scores.values())
    run = ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **config})
    assert tuner_of(run) == "lora" and not trains_backbone(run)  # Per-FedAvg: the components
    initial = initial_trainable(run, "lora", 0, train_backbone=False)
    for client, reply in replies:
        arrays = reply.content.array_records.get(P.ARRAYS)
        keys = set(from_array_record(arrays)) if arrays is not None else set()
        if method == "local" or reply.metadata.message_type != "train":
            assert not keys
        else:
            assert keys == set(initial.names_for(client_tasks(client, 4)))


@pytest.mark.parametrize("aggregation", ["data-size", "uniform"])
def test_eq1_averages_each_component_over_its_owners_by_the_chosen_weights(
    aggregation: str,
) -> None:
    """data-size: sum_i |D_i| x_i / sum_i |D_i| over a component's owners (eq. 1); uniform:
    1 / K_r each (App. B). The decoder has two owners, the encoder three."""
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.models import TrainableTensors
    from strategies.parts.replies import ClientReply
    from strategies.tap import TAPStrategy

    initial = TrainableTensors(
        {"enc.w": torch.zeros(3), "dec.w": torch.zeros(2)},
        {"enc.w": "encoder.image", "dec.w": "decoder.image-classification"},
        {"encoder.image": frozenset({"a", "b"}), "decoder.image-classification": frozenset({"a"})},
    )
    config = ExperimentConfig(method="tap", dataset="multitask", backbone="mm-offline").replace(
        tap_aggregation=aggregation
    )
    strategy = TAPStrategy(config, initial)
    rng = np.random.default_rng(0)
    sizes = {0: 30, 1: 10, 2: 20}
    sent = {
        0: {"enc.w": rng.normal(size=3), "dec.w": rng.normal(size=2)},
        1: {"enc.w": rng.normal(size=3)},
        2: {"enc.w": rng.normal(size=3), "dec.w": rng.normal(size=2)},
    }
    replies = [
        ClientReply(
            c, c + 1, {k: torch.tensor(v, dtype=torch.float32) for k, v in t.items()}, sizes[c], {}
        )
        for c, t in sent.items()
    ]
    strategy.aggregate(1, replies)
    for name in ("enc.w", "dec.w"):
        owners = [c for c in sent if name in sent[c]]
        weights = [sizes[c] if aggregation == "data-size" else 1.0 for c in owners]
        expected = sum(w * sent[c][name] for w, c in zip(weights, owners, strict=True)) / sum(
            weights
        )
        np.testing.assert_allclose(strategy.global_tensors[name].numpy(), expected, rtol=1e-6)


def test_tap_under_local_dp_sends_noised_clipped_components_and_nothing_after_the_rounds(
    tap_config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TAP under local DP, 1 round and the post-FL round: each client sends exactly the
    components it received (its pairs'), each reply its received components plus their clipped
    update plus the noise the client drew (std sigma C per value); the distillation round sends
    nothing up and counts no release."""
    from test_privacy import NoiseSpy
    from traffic import assert_locally_noised, local_dp, run_recording

    clip, sigma = 0.05, 2.0
    spy = NoiseSpy(monkeypatch)
    config = {**tap_config, **local_dp(clip, sigma), "run-name": "local-dp", "num-server-rounds": 1}
    summary, traffic = run_recording(config, 4)
    assert sorted(traffic) == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)]
    for (server_round, _), (received, sent) in traffic.items():
        if server_round == 2:  # the post-FL distillation round
            assert sent == {}
        else:
            assert_locally_noised(sent, received, spy.draws, clip, sigma)
    assert len(spy.draws) == 4  # one release per client, none after the rounds
    assert summary["dp-releases"] == 1
