"""FedPerfix: the prefix equations, eq. 6, partial personalization by name, end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.registry import tuner_of
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.models import build_model, initial_trainable
from fedfm_flower.models.groups import TrainableTensors, select_names, split_names
from fedfm_flower.models.tuners.mlp_adapter import BottleneckAdapter
from fedfm_flower.models.tuners.prefix import LinearPrefix, PrefixAdapter, PrefixedAttention
from fedfm_flower.models.vit_parts import VIT_PARTS
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import record_names

WIDTH, HEADS, TOKENS = 8, 2, 5


def _attention() -> nn.Module:
    from timm.models.vision_transformer import Attention

    torch.manual_seed(0)
    return Attention(WIDTH, num_heads=HEADS, qkv_bias=True).eval()


def _prefixed(form: str, scale: float = 1.5) -> PrefixedAttention:
    torch.manual_seed(1)
    return PrefixedAttention(_attention(), PrefixAdapter(WIDTH, WIDTH, 4), scale, form).eval()


def _softmax_attention(q, k, v):  # noqa: ANN001, ANN202 - (B, H, N, d) tensors
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v


def _by_head(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1], HEADS, WIDTH // HEADS).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).reshape(x.shape[0], -1, WIDTH)


def _hand_projections(module: PrefixedAttention, z: torch.Tensor):  # noqa: ANN202
    w, b = module.qkv.weight, module.qkv.bias
    q, k, v = (z @ w.T + b).split(WIDTH, dim=-1)
    adapter = module.prefix
    prefixes = torch.tanh(z @ adapter.down.weight.T + adapter.down.bias)
    prefixes = prefixes @ adapter.up.weight.T + adapter.up.bias  # eq. 4
    p_k, p_v = (module.scale * prefixes).split(WIDTH, dim=-1)  # eq. 5: s P
    return q, k, v, p_k, p_v


def test_parallel_prefixes_enter_the_keys_and_values_of_every_head() -> None:
    module = _prefixed("parallel")
    z = torch.randn(3, TOKENS, WIDTH)
    q, k, v, p_k, p_v = _hand_projections(module, z)
    heads = _softmax_attention(_by_head(q), _by_head(k + p_k), _by_head(v + p_v))
    expected = _merge(heads) @ module.proj.weight.T + module.proj.bias
    assert torch.allclose(module(z), expected, atol=1e-5)
    # The queries are untouched: with s = 0 it is the plain attention of the same weights.
    plain = _attention()
    zero = PrefixedAttention(plain, PrefixAdapter(WIDTH, WIDTH, 4), 0.0, "parallel").eval()
    assert torch.allclose(zero(z), _attention()(z), atol=1e-6)


def test_eq6_concatenated_prefixes_mix_aggregated_and_prefix_attention() -> None:
    """Eq. 6: head(x) = (1 - lambda) Attn(q, K, V) + lambda Attn(q, sP_k, sP_v), per token."""
    module = _prefixed("concat")
    z = torch.randn(2, TOKENS, WIDTH)
    q, k, v, p_k, p_v = (_by_head(t) for t in _hand_projections(module, z))
    aggregated = _softmax_attention(q, k, v)
    personal = _softmax_attention(q, p_k, p_v)
    scale = 1 / math.sqrt(WIDTH // HEADS)
    mass_prefix = torch.exp(q @ p_k.transpose(-1, -2) * scale).sum(-1, keepdim=True)
    mass_own = torch.exp(q @ k.transpose(-1, -2) * scale).sum(-1, keepdim=True)
    lam = mass_prefix / (mass_prefix + mass_own)  # normalised attention weight on the prefixes
    assert lam.shape == (2, HEADS, TOKENS, 1) and 0 < lam.min() and lam.max() < 1
    mixed = (1 - lam) * aggregated + lam * personal
    expected = _merge(mixed) @ module.proj.weight.T + module.proj.bias
    assert torch.allclose(module(z), expected, atol=1e-5)
    # The parallel form is a different function of the same weights (eq. 6 is the concat one's).
    parallel = PrefixedAttention(module, module.prefix, 1.5, "parallel").eval()
    assert not torch.allclose(parallel(z), module(z), atol=1e-3)


def test_zero_initialised_plugins_leave_the_vit_unchanged_and_random_ones_do_not() -> None:
    config = ExperimentConfig(method="fedperfix", prefix_bottleneck=8, mlp_adapter_bottleneck=8)
    images = torch.randn(2, 3, 16, 16)
    plain = build_model(config, "none", 10, load_weights=False).eval()
    cases = (("prefix-zero", True), ("mlp-adapter", True), ("prefix-random", False))
    for tuner, unchanged in cases:
        model = build_model(config, tuner, 10, load_weights=False).eval()
        assert torch.allclose(model(images), plain(images), atol=1e-6) is unchanged, tuner
    assert isinstance(LinearPrefix(4, 4, zero=True).kv.weight, nn.Parameter)
    assert torch.count_nonzero(BottleneckAdapter(4, 2).up.weight) == 0


def test_trainable_vit_parts_are_named_groups_and_prefixes_win_over_attention() -> None:
    config = ExperimentConfig(method="fedperfix", prefix_bottleneck=8)
    frozen = build_model(config, "perfix", 10, load_weights=False)
    assert set(frozen.parameter_groups().values()) == {"prefix", "head"}
    model = build_model(config, "perfix", 10, load_weights=False, train_backbone=True)
    groups = model.parameter_groups()
    assert set(groups.values()) == {"prefix", "head", *VIT_PARTS}
    assert groups["backbone.blocks.0.attn.prefix.down.weight"] == "prefix"
    assert groups["backbone.blocks.0.attn.qkv.weight"] == "vit.attn"
    assert groups["backbone.blocks.3.norm2.bias"] == "vit.norm"
    assert groups["backbone.norm.weight"] == "vit.norm"
    # Every parameter of a trainable ViT is in a group: none is left frozen by omission.
    assert set(groups) == {n for n, _ in model.named_parameters()}
    # The ViT keeps its parameter names under the prefixed attention.
    plain = build_model(config, "none", 10, load_weights=False, train_backbone=True)
    assert set(plain.parameter_groups()) == {n for n in groups if groups[n] != "prefix"}


def test_personal_parts_by_group_or_pattern_and_unknown_ones_are_refused() -> None:
    groups = {
        "backbone.blocks.0.attn.qkv.weight": "vit.attn",
        "backbone.blocks.11.attn.qkv.weight": "vit.attn",
        "backbone.blocks.0.attn.prefix.up.weight": "prefix",
        "head.weight": "head",
    }
    assert select_names(["vit"], groups) == list(groups)[:2]
    assert select_names([r"blocks\.11\."], groups) == ["backbone.blocks.11.attn.qkv.weight"]
    shared, local = split_names(groups, None, ["prefix", "head"], strict=True)
    assert shared == list(groups)[:2] and local == list(groups)[2:]
    with pytest.raises(ValueError, match="'prefx' selects no trainable parameter"):
        split_names(groups, None, ["prefx", "head"], strict=True)
    with pytest.raises(ConfigError, match="fedperfix-personal"):
        ExperimentConfig().replace(fedperfix_personal="head,blocks[")
    with pytest.raises(ConfigError, match="train-backbone"):
        ExperimentConfig(
            method="fedperfix", dataset="instructions", backbone="tiny-llama"
        ).validate()


def test_shared_parts_are_the_independent_weighted_average_and_personal_parts_stay() -> None:
    from flwr.app import Message, MetricRecord, RecordDict

    from fedfm_flower.records.messages import to_array_record
    from server_apps.inprocess import InProcessGrid, identity_app
    from strategies.fedavg import FedAvgStrategy

    initial = TrainableTensors(
        {"vit.w": torch.zeros(3), "prefix.w": torch.zeros(2), "head.w": torch.zeros(2)},
        {"vit.w": "vit.attn", "prefix.w": "prefix", "head.w": "head"},
    )
    config = ExperimentConfig(method="fedperfix", num_clients=3)
    strategy = FedAvgStrategy(config, initial)
    assert set(strategy.global_tensors) == {"vit.w"}
    nodes = [{"client-id": i} for i in range(3)]
    grid = InProcessGrid(identity_app(), config.to_run_config(), nodes)
    messages = list(strategy.configure_train(1, None, {}, grid))
    assert all(set(record_names(m.content[P.ARRAYS])) == {"vit.w"} for m in messages)
    sent = {c: torch.randn(3, generator=torch.Generator().manual_seed(c)) for c in range(3)}
    counts = {0: 10, 1: 30, 2: 60}
    replies = []
    for message in messages:
        client = int(message.content[P.CONFIG][P.CLIENT_ID])
        metrics = MetricRecord({P.CLIENT_ID: client, P.NUM_EXAMPLES: counts[client]})
        arrays = to_array_record({"vit.w": sent[client]})
        content = RecordDict({P.ARRAYS: arrays, P.METRICS: metrics})
        replies.append(Message(content, reply_to=message))
    strategy.aggregate_train(1, replies)
    expected = sum(counts[c] * sent[c].double() for c in range(3)) / sum(counts.values())
    assert torch.allclose(strategy.global_tensors["vit.w"].double(), expected, atol=1e-7)
    # A reply carrying a personal tensor is refused (it is not in the reply spec).
    assert set(strategy.reply_spec(0)) == {"vit.w"}


def _rounds(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def fedperfix_config(small_run_config: dict, tmp_path: Path) -> dict:
    """FedPerfix on the tiny ViT: small prefix adapters, client state on disk."""
    return {
        **small_run_config,
        "method": "fedperfix",
        "prefix-bottleneck": 16,
        "lr": 0.01,
        "client-state-dir": str(tmp_path / "state"),
    }


def test_personal_prefixes_never_travel_and_are_restored_after_a_restart(
    fedperfix_config: dict,
) -> None:
    from safetensors.torch import load_file

    from server_apps.inprocess import ServerCrash, crash_in_round, run_in_process

    base = {**fedperfix_config, "num-server-rounds": 3}
    replies = []

    def keep(client_id, reply):  # noqa: ANN001, ANN202
        replies.append(reply)
        return reply

    full, grid = run_in_process({**base, "run-name": "whole"}, 4, keep)
    for message in grid.sent:
        arrays = message.content.array_records.get(P.ARRAYS)
        names = set(record_names(arrays)) if arrays is not None else set()
        assert not any(".attn.prefix." in n or n.startswith("head.") for n in names)
        if message.metadata.message_type == "train":
            assert "backbone.blocks.0.attn.qkv.weight" in names
    assert replies
    for reply in replies:
        arrays = reply.content.array_records.get(P.ARRAYS)
        names = set(record_names(arrays)) if arrays is not None else set()
        assert not any(".attn.prefix." in n or n.startswith("head.") for n in names)
    # Each client's prefixes are its own (they differ), on disk in its state directory.
    state = Path(base["client-state-dir"]) / "whole"
    prefixes = [
        load_file(sorted(d.glob("round_*.safetensors"))[-1]) for d in sorted(state.iterdir())
    ]
    assert len(prefixes) == 4
    name = "backbone.blocks.0.attn.prefix.up.weight"
    assert all(not torch.equal(prefixes[0][name], p[name]) for p in prefixes[1:])
    assert set(prefixes[0]) == {
        n for n in prefixes[0] if ".attn.prefix." in n or n.startswith("head.")
    }
    # A restart (fresh contexts) picks the personal parts up from disk: same final metrics.
    with pytest.raises(ServerCrash):
        run_in_process({**base, "run-name": "crashed"}, 4, crash_in_round(3))
    resumed, _ = run_in_process({**base, "run-name": "crashed", "resume": True}, 4)
    assert resumed["final-per-client-accuracy"] == full["final-per-client-accuracy"]


def test_partial_participation_k_of_n(fedperfix_config: dict) -> None:
    from server_apps.inprocess import run_in_process

    config = {**fedperfix_config, "fraction-train": 0.5, "num-server-rounds": 3}
    summary, grid = run_in_process(config, 4)
    rounds = _rounds(Path(config["output-dir"]) / summary["run-name"])
    assert all(r["clients-sampled"] == 2 and r["clients-reported"] == 2 for r in rounds)
    assert len({tuple(r["sampled"]) for r in rounds}) > 1
    trained = {
        int(m.content[P.CONFIG][P.CLIENT_ID])
        for m in grid.sent
        if m.metadata.message_type == "train"
    }
    assert trained <= {0, 1, 2, 3}
    assert summary["final-test-accuracy-mean"] > 0.2


@pytest.mark.parametrize(
    ("personal", "local_groups"),
    [
        ("vit.norm", {"vit.norm"}),  # FedBN
        ("vit.attn,head", {"vit.attn", "head"}),  # FedPer / Vanilla Attention
        ("", set()),  # everything averaged: FedAvg of the whole ViT
    ],
)
def test_baselines_by_personal_parts(personal: str, local_groups: set[str]) -> None:
    config = ExperimentConfig(method="fedperfix", tuner="none").replace(fedperfix_personal=personal)
    initial = initial_trainable(config, "none", 10, train_backbone=True)
    from strategies.fedavg import FedAvgStrategy

    strategy = FedAvgStrategy(config, initial)
    shared_groups = {initial.groups[n] for n in strategy.global_tensors}
    assert shared_groups == set(initial.groups.values()) - local_groups


@pytest.mark.parametrize("variant", ["prompts", "adapters", "prefix-zero", "concat", "fedbn"])
def test_table6_designs_and_baselines_run_end_to_end(variant: str, fedperfix_config: dict) -> None:
    import tomllib

    from server_apps.inprocess import run_in_process

    overlay = tomllib.loads(Path(f"configs/fedperfix/{variant}.toml").read_text())
    config = {**fedperfix_config, **overlay, "num-server-rounds": 1, "num-clients": 2}
    summary, grid = run_in_process(config, 2)
    assert summary["final-test-accuracy-mean"] > 0.2
    personal = overlay.get("fedperfix-personal", "prefix,head").split(",")
    for message in grid.sent:
        arrays = message.content.array_records.get(P.ARRAYS)
        names = set(record_names(arrays)) if arrays is not None else set()
        run = ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **config})
        groups = initial_trainable(run, tuner_of(run), 10, train_backbone=True).groups
        assert not set(select_names(personal, groups)) & names


@pytest.mark.parametrize(
    "setup", ["cifar100-dir0.1-vit-s16", "office-home-vit-s16", "organamnist-dir0.5-vit-s16"]
)
def test_paper_setups_build_vit_s_from_random_init_as_the_authors_presets(
    setup: str, tmp_path: Path
) -> None:
    """The authors' presets build ViT-S/16 with ``pretrained=False`` (``no_pt``) and lr 0.01;
    the setup files follow them, so FedPerfix's model builds offline (no Hub download: the
    suite runs with HF_HUB_OFFLINE) from seeded random weights."""
    from fedfm_flower.study.sweep import cell_config

    raw = cell_config("fedperfix", setup, 0, tmp_path)
    config = ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **raw})
    assert config.pretrained is False and config.lr == 0.01
    assert config.backbone == "vit_small_patch16_224" and config.image_size == 224
    model = build_model(
        config, tuner_of(config), num_outputs=11, load_weights=True, train_backbone=True
    )
    again = build_model(
        config, tuner_of(config), num_outputs=11, load_weights=True, train_backbone=True
    )
    first, second = model.trainable().tensors, again.trainable().tensors
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)  # seeded, not downloaded
