"""Per-client resources (FedPerfix's Table 2): hand counts on tiny-vit and ViT-S/16, MACs."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.registry import METHODS
from fedfm_flower.study.resources import forward_macs, main, method_resources

# tiny-vit (fedfm_flower.models.backbones.TINY_VIT) on 16 px digits, 10 classes, prefix b = 16.
D, DEPTH, HIDDEN, PATCH, IMAGE, CLASSES, B = 64, 4, 128, 4, 16, 10, 16
PATCHES = (IMAGE // PATCH) ** 2
N = PATCHES + 1  # tokens with the class token

PATCH_EMBED = 3 * PATCH * PATCH * D + D
TOKENS = D + N * D  # cls token + position embedding
NORMS = DEPTH * 2 * (2 * D) + 2 * D  # norm1, norm2 per block, the final norm
ATTN = (D * 3 * D + 3 * D) + (D * D + D)  # qkv, proj per block
MLP = (D * HIDDEN + HIDDEN) + (HIDDEN * D + D)
VIT = PATCH_EMBED + TOKENS + NORMS + DEPTH * (ATTN + MLP)
HEAD = D * CLASSES + CLASSES
PREFIX = (D * B + B) + (B * 2 * D + 2 * D)  # down, up per block

# Forward MACs of one sample: patch convolution, per block qkv, QK^T, AV, proj, fc1, fc2; head.
BLOCK_MACS = N * D * 3 * D + 2 * N * N * D + N * D * D + 2 * N * D * HIDDEN
VIT_MACS = PATCHES * D * 3 * PATCH * PATCH + DEPTH * BLOCK_MACS + D * CLASSES
PREFIX_MACS = DEPTH * N * (D * B + B * 2 * D)


def _tiny(method: str = "fedavg", **keys: object) -> ExperimentConfig:
    run_config = {"method": method, "train-backbone": True, "tuner": "none"}
    return ExperimentConfig.from_run_config({**run_config, "prefix-bottleneck": B, **keys})


def test_hand_counts_match_timm() -> None:
    from timm.models.vision_transformer import Attention, VisionTransformer

    with torch.device("meta"):
        vit = VisionTransformer(
            img_size=IMAGE, patch_size=PATCH, embed_dim=D, depth=DEPTH, num_heads=4, mlp_ratio=2
        )
    vit.reset_classifier(CLASSES)

    def numel(kind: type) -> int:
        return sum(p.numel() for m in vit.modules() if isinstance(m, kind) for p in m.parameters())

    assert sum(p.numel() for p in vit.parameters()) == VIT + HEAD
    assert (numel(nn.LayerNorm), numel(Attention)) == (NORMS, DEPTH * ATTN)


@pytest.mark.parametrize(
    ("config", "storage", "upload"),
    [
        (_tiny("fedavg"), VIT + HEAD, VIT + HEAD),
        (_tiny("local"), VIT + HEAD, 0),
        (_tiny("fedrep"), VIT + HEAD, VIT),
        (_tiny("fedperfix", tuner="perfix"), VIT + HEAD + DEPTH * PREFIX, VIT),
        (_tiny("fedperfix", **{"fedperfix-personal": "vit.norm"}), VIT + HEAD, VIT + HEAD - NORMS),
        (
            _tiny("fedperfix", **{"fedperfix-personal": "vit.attn,head"}),
            VIT + HEAD,
            VIT - DEPTH * ATTN,
        ),
        (_tiny("fedbabu"), VIT + HEAD, VIT),
        (_tiny("apfl"), 2 * (VIT + HEAD) + 1, VIT + HEAD),
        (_tiny("per-fedavg"), VIT + HEAD, VIT + HEAD),
    ],
    ids=["fedavg", "local", "fedrep", "fedperfix", "fedbn", "vanilla-attn", "babu", "apfl", "pfa"],
)
def test_storage_and_communication_match_hand_counts(
    config: ExperimentConfig, storage: int, upload: int
) -> None:
    row = method_resources(config)
    assert (row.num_outputs, row.storage_params, row.upload_params) == (CLASSES, storage, upload)
    kept = {"local": VIT + HEAD, "apfl": VIT + HEAD + 1, "fedavg": 0, "per-fedavg": 0}
    if config.method in kept:
        assert row.local_params == kept[config.method]
    assert row.download_equals_upload
    assert row.fedavg_storage_params == row.fedavg_upload_params == VIT + HEAD


def test_computation_ratios() -> None:
    fedavg, fedperfix, apfl, per_fedavg, local = (
        method_resources(c)
        for c in (
            _tiny("fedavg"),
            _tiny("fedperfix", tuner="perfix"),
            _tiny("apfl"),
            _tiny("per-fedavg"),
            _tiny("local"),
        )
    )
    assert fedavg.forward_macs == fedavg.train_macs == VIT_MACS
    assert fedavg.computation_ratio == local.computation_ratio == 1.0
    assert apfl.train_macs == per_fedavg.train_macs == 2 * fedavg.train_macs
    assert apfl.computation_ratio == per_fedavg.computation_ratio == 2.0
    assert fedperfix.forward_macs == VIT_MACS + PREFIX_MACS
    assert 1.0 < fedperfix.computation_ratio < 1.1


def test_mac_counts_of_single_layers() -> None:
    x = torch.zeros(2, N, D)
    assert forward_macs(nn.Linear(D, HIDDEN), x) == 2 * N * D * HIDDEN
    conv = nn.Conv2d(3, D, PATCH, stride=PATCH)
    assert forward_macs(conv, torch.zeros(1, 3, IMAGE, IMAGE)) == PATCHES * D * 3 * PATCH * PATCH
    q, kv = torch.zeros(1, 4, N, D // 4), torch.zeros(1, 4, 2 * N, D // 4)  # concat prefixes
    assert forward_macs(lambda: F.scaled_dot_product_attention(q, kv, kv)) == 2 * N * 2 * N * D


def test_fused_and_explicit_attention_count_alike() -> None:
    from timm.models.vision_transformer import Attention

    attention = Attention(D, num_heads=4, qkv_bias=True).eval()
    x = torch.zeros(1, N, D)
    fused = forward_macs(attention, x)
    attention.fused_attn = False  # q @ k^T and attn @ v as plain matmuls
    assert forward_macs(attention, x) == fused == N * D * 3 * D + 2 * N * N * D + N * D * D


IMAGE_METHODS = sorted(m for m, s in METHODS.items() if not s.modalities or "image" in s.modalities)


@pytest.mark.parametrize("method", IMAGE_METHODS)
def test_the_upload_counted_is_what_the_strategy_sends(method: str) -> None:
    from fedfm_flower.methods.halves import strategy_class
    from fedfm_flower.methods.registry import trains_backbone, tuner_of
    from fedfm_flower.models import initial_trainable

    config = _tiny(method, tuner="auto", **{"train-backbone": False, "num-clients": 2})
    row = method_resources(config)
    initial = initial_trainable(
        config, tuner_of(config), CLASSES, train_backbone=trains_backbone(config)
    )
    strategy = strategy_class(method)(config, initial)
    if method == "pefll":  # client 0 has sent a descriptor: the steady round (with a Jacobian)
        server = strategy.require_server()
        server.descriptors[0] = 1.0
        server.descriptor_rounds[0] = 1
    payload = strategy.train_payload(0, 2)
    reply = strategy.reply_spec(0)
    assert row.download_params == sum(t.numel() for t in payload.values())
    assert row.upload_params == sum(math.prod(shape) for shape, _ in reply.values())
    if METHODS[method].profile.traffic is None:  # the shared tensors, once each way
        assert row.download_params == row.upload_params
        assert row.upload_params + row.local_params <= row.storage_params


def test_command_rows_variants_and_labels(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "fedperfix").mkdir()
    (tmp_path / "fedperfix" / "fedbn.toml").write_text(
        'tuner = "none"\nfedperfix-personal = "vit.norm"\n'
    )
    common = ["--format", "csv", "--configs", str(tmp_path)]
    common += ["--set", "train-backbone=true", "tuner=none"]
    assert main(["--methods", "fedavg", "fedperfix:fedbn", *common]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["label"] for r in rows] == ["fedavg", "fedperfix:fedbn"]
    assert [int(r["upload_params"]) for r in rows] == [VIT + HEAD, VIT + HEAD - NORMS]
    fedbn_set = ["--label", "fedbn", "--set", "fedperfix-personal=vit.norm"]
    assert main(["--methods", "fedperfix", *common, *fedbn_set]) == 0
    again = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert again[0]["label"] == "fedbn"
    assert {k: v for k, v in again[0].items() if k != "label"} == {
        k: v for k, v in rows[1].items() if k != "label"
    }
    assert main(["--methods", "no-such-method", *common]) == 2


def test_vit_s16_against_the_paper() -> None:
    import timm

    base = {
        "backbone": "vit_small_patch16_224",
        "image-size": 224,
        "pretrained": False,
        "train-backbone": True,
        "tuner": "none",
        "dataset": "cifar100",
    }
    fedavg = method_resources(ExperimentConfig.from_run_config({**base, "method": "fedavg"}))
    fedperfix = method_resources(
        ExperimentConfig.from_run_config({**base, "method": "fedperfix", "tuner": "perfix"})
    )
    attention = method_resources(
        ExperimentConfig.from_run_config(
            {**base, "method": "fedperfix", "fedperfix-personal": "vit.attn,head"}
        )
    )
    with torch.device("meta"):
        vit_s = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=100)
    assert fedavg.num_outputs == 100
    assert fedavg.storage_params == sum(p.numel() for p in vit_s.parameters()) == 21_704_164
    # The paper's 21.03M is timm's ViT-S with its 1000-class head (22,050,664 parameters) in
    # units of 2^20; ours has a 100-class head (900 x 385 fewer) and is within 5% of 21.03e6.
    assert round((fedavg.storage_params + 900 * 385) / 2**20, 2) == 21.03
    assert abs(fedavg.storage_params / 21.03e6 - 1) < 0.05
    width, bottleneck = 384, 256
    prefixes = 12 * (width * bottleneck + bottleneck + bottleneck * 2 * width + 2 * width)
    assert fedperfix.storage_params - fedavg.storage_params == prefixes
    assert fedperfix.upload_params == fedavg.upload_params - (width * 100 + 100)
    assert abs(attention.communication_ratio - 13.89 / 21.03) < 0.02
    assert 1.0 < fedperfix.computation_ratio < 1.2  # prefix adapters: ~15% more MACs


def test_apple_stores_and_downloads_every_clients_core() -> None:
    keys = {"tuner": "auto", "train-backbone": False, "num-clients": 4}
    fedavg, apple = (method_resources(_tiny(m, **keys)) for m in ("fedavg", "apple"))
    trainable = fedavg.upload_params  # FedAvg and APPLE share every trainable tensor
    assert apple.upload_params == trainable and apple.download_params == 4 * trainable
    assert apple.storage_params == fedavg.storage_params + 4 * trainable  # N cores + w_i
    with pytest.raises(ValueError, match="set num-clients"):
        method_resources(_tiny("apple", **{**keys, "num-clients": 0}))


def test_fedrod_stores_a_second_head_and_shares_what_fedavg_shares() -> None:
    """FedRoD's personal head h_P has the head's shape: one more head stored, never sent."""
    keys = {"tuner": "auto", "train-backbone": False}
    fedavg, fedrod = (method_resources(_tiny(m, **keys)) for m in ("fedavg", "fedrod"))
    head = fedavg.num_outputs * D + fedavg.num_outputs  # weight and bias of a head
    assert fedrod.storage_params == fedavg.storage_params + head
    assert fedrod.local_params == fedavg.local_params + head
    assert (fedrod.upload_params, fedrod.download_params) == (
        fedavg.upload_params,
        fedavg.download_params,
    )
