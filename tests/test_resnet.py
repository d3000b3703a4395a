"""The resnet family: ResNets trained whole, their BatchNorm statistics carried with their layer.

A BatchNorm's running statistics are no parameters but travel, average and stay local as its
weight does (``fedfm_flower.models.groups``): FedAvg averages them like the weights, FedBN keeps
them on the client, no optimizer steps them, and a frozen backbone's stay bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.models import build_model
from fedfm_flower.models.backbones import backbone_fingerprint
from fedfm_flower.models.groups import BACKBONE, CARRIED_STATISTICS, group_of
from fedfm_flower.models.resnet_parts import RESNET_PART_PATTERNS
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import from_array_record, record_names
from server_apps.inprocess import run_in_process


def _resnet(small_run_config: dict, **extra: object) -> dict:
    return {
        **small_run_config,
        "backbone": "tiny-resnet",
        "tuner": "none",
        "train-backbone": True,
        "local-steps": 2,
        **extra,
    }


def _config(run_config: dict) -> ExperimentConfig:
    return ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **run_config})


def _norms(model: nn.Module) -> dict[str, nn.Module]:
    return {
        n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }


def test_every_resnet50_weight_has_its_part_and_every_batchnorm_is_a_norm() -> None:
    import timm

    with torch.device("meta"):
        resnet = timm.create_model("resnet50", pretrained=False, num_classes=0)
    names = [f"backbone.{n}" for n, _ in resnet.named_parameters()]
    groups = {n: group_of(n, RESNET_PART_PATTERNS) for n in names}
    assert BACKBONE not in groups.values()
    assert "resnet.other" not in groups.values()  # plain ResNet50: every weight has its role
    norms = {f"backbone.{n}" for n in _norms(resnet)}
    assert len(norms) == 53  # 1 stem + 16 blocks x 3 + 4 shortcuts
    for name, group in groups.items():
        module = name.rsplit(".", 1)[0]
        assert (group == "resnet.norm") == (module in norms), name
    assert groups["backbone.conv1.weight"] == "resnet.stem"
    assert groups["backbone.layer3.0.downsample.0.weight"] == "resnet.conv"


def test_batchnorm_statistics_follow_their_layer_but_no_optimizer_sees_them(
    small_run_config: dict,
) -> None:
    config = _config(_resnet(small_run_config))
    model = build_model(config, "none", 10, train_backbone=True)
    groups = model.parameter_groups()
    norms = _norms(model)
    assert norms
    for prefix in norms:
        for buffer in CARRIED_STATISTICS:
            assert groups[f"{prefix}.{buffer}"] == "resnet.norm"
        assert f"{prefix}.num_batches_tracked" not in groups
    params = model.parameters_named(groups)
    assert all(isinstance(p, nn.Parameter) for p in params.values())
    assert set(groups) - set(params) == {f"{p}.{b}" for p in norms for b in CARRIED_STATISTICS}
    assert set(model.group_parameters(["resnet.norm"])) == {
        n for n in params if groups[n] == "resnet.norm"
    }
    # They are the model's tensors: read, written and in the trainable state like a weight.
    name = next(iter(norms)) + ".running_var"
    assert name in model.trainable().tensors
    three = torch.full_like(model.tensors_named([name])[name], 3.0)
    model.load_tensors({name: three})
    assert torch.equal(dict(model.named_buffers())[name], three)
    # A variance noised below 0 (DP) is loaded as 0: the layer stays finite.
    noised = three.clone()
    noised[0] = -0.5
    model.load_tensors({name: noised})
    assert dict(model.named_buffers())[name][0] == 0.0
    model.eval()
    assert torch.isfinite(model(torch.randn(2, 3, config.image_size, config.image_size))).all()


def test_a_frozen_resnet_keeps_its_statistics_bit_identical_while_its_head_trains(
    small_run_config: dict,
) -> None:
    """A linear probe (tuner none, backbone frozen): the backbone's BatchNorms stay in eval
    mode, so training moves the head and nothing of the backbone, statistics included; they
    are backbone, never sent."""
    from fedfm_flower.tasks.classification import ImageClassification
    from fedfm_flower.tasks.training import train

    config = _config(_resnet(small_run_config, **{"train-backbone": False}))
    model = build_model(config, "none", 10)
    assert set(model.parameter_groups().values()) == {"head"}
    before, head = backbone_fingerprint(model.backbone), model.head.weight.detach().clone()
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(64, 3, config.image_size, config.image_size, generator=generator)
    data = torch.utils.data.TensorDataset(images * 3 + 1, torch.arange(64) % 10)
    params = model.parameters_named(model.parameter_groups()).values()
    stats = train(ImageClassification(), model, data, params, config, seed=0)
    assert stats.num_steps == 2 and model.training  # local-steps
    assert not any(m.training for m in _norms(model).values())
    assert backbone_fingerprint(model.backbone) == before  # weights, statistics
    assert not torch.equal(model.head.weight, head)
    # The same steps with the BatchNorms in train mode (as nn.Module.train would leave them)
    # move the statistics: the check above can fail.
    nn.Module.train(model)
    with torch.no_grad():
        model(images * 3 + 1)
    assert backbone_fingerprint(model.backbone) != before


def _replies(method_config: dict) -> tuple[dict, list, list]:
    replies = []

    def keep(client_id, reply):  # noqa: ANN001, ANN202
        replies.append(reply)
        return reply

    summary, grid = run_in_process(method_config, method_config["num-clients"], keep)
    return summary, grid.sent, replies


def test_fedavg_averages_batchnorm_statistics_weighted_like_the_weights(
    small_run_config: dict,
) -> None:
    run = _resnet(small_run_config, method="fedavg", **{"num-server-rounds": 1})
    summary, sent, replies = _replies(run)
    train = [r for r in replies if r.metadata.message_type == "train" and r.content.array_records]
    assert len(train) == 4
    tensors = [from_array_record(r.content.array_records[P.ARRAYS]) for r in train]
    weights = [float(r.content.metric_records[P.METRICS][P.NUM_EXAMPLES]) for r in train]
    assert len(set(weights)) > 1  # a weighted mean, not a plain one
    name = "backbone.layer2.0.bn1.running_mean"
    assert all(name in t for t in tensors)
    # Each client's statistics moved to its own data.
    assert not torch.equal(tensors[0][name], tensors[1][name])
    want = sum(w * t[name].double() for w, t in zip(weights, tensors, strict=True)) / sum(weights)
    state = load_file(
        Path(run["output-dir"]) / summary["run-name"] / "checkpoints" / "round_00001.safetensors"
    )
    key = next(k for k in state if k.endswith(name))
    torch.testing.assert_close(state[key].double(), want, rtol=1e-5, atol=1e-6)
    assert any(
        m.metadata.message_type == "train"
        and name in record_names(m.content.array_records[P.ARRAYS])
        for m in sent
    )


def test_fedbn_keeps_batchnorm_weights_and_statistics_on_the_client(
    small_run_config: dict, tmp_path: Path
) -> None:
    run = _resnet(
        small_run_config,
        method="fedperfix",
        **{
            "fedperfix-personal": "resnet.norm",
            "client-state-dir": str(tmp_path / "state"),
            "num-clients": 2,
        },
    )
    summary, sent, replies = _replies(run)
    assert summary["rounds"] == 2
    for message in [*sent, *replies]:
        arrays = message.content.array_records.get(P.ARRAYS)
        names = record_names(arrays) if arrays is not None else []
        assert not any(".bn" in n or "downsample.1." in n for n in names), names[:3]
    kept = [
        load_file(sorted(d.glob("round_*.safetensors"))[-1])
        for d in sorted((tmp_path / "state" / summary["run-name"]).iterdir())
    ]
    assert len(kept) == 2
    name = "backbone.bn1.running_var"
    assert all(name in k for k in kept)
    assert all(not torch.equal(kept[0][name], k[name]) for k in kept[1:])


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        ({"method": "apple"}, "method", "BatchNorm statistics"),
        ({"method": "fedala"}, "method", "BatchNorm statistics"),
        ({"method": "fedvpt", "tuner": "auto"}, "tuner", "takes the tuner 'none' only"),
        ({"method": "pfedseq", "tuner": "auto"}, "tuner", "takes the tuner 'none' only"),
    ],
)
def test_a_method_that_cannot_run_on_a_resnet_is_refused_naming_why(
    small_run_config: dict, extra: dict, key: str, words: str
) -> None:
    with pytest.raises(ConfigError, match=words) as caught:
        _config(_resnet(small_run_config, **extra))
    assert caught.value.key == key


def test_the_offline_resnet_is_pretrained_and_cached_apart_from_the_vit(
    small_run_config: dict,
) -> None:
    from fedfm_flower.models.foundation import foundation_card, foundation_key

    resnet = _config(_resnet(small_run_config))
    vit = _config({**small_run_config})
    assert foundation_key(resnet) != foundation_key(vit)
    card = foundation_card(resnet)
    assert card["public_test_accuracy"] > 0.6  # 10 classes: chance is 0.1


@pytest.mark.parametrize("method", ["per-fedavg", "pfedme"])
def test_methods_with_their_own_steps_send_the_statistics_their_steps_updated(
    method: str, small_run_config: dict
) -> None:
    """Per-FedAvg and pFedMe step parameters by hand; their replies still carry the layer's
    statistics (the server refuses a reply missing them), moved by the client's forward passes."""
    run = _resnet(small_run_config, method=method, **{"num-server-rounds": 1, "num-clients": 2})
    summary, sent, replies = _replies(run)
    assert summary["rounds"] == 1
    first = next(m for m in sent if m.metadata.message_type == "train")
    start = from_array_record(first.content.array_records[P.ARRAYS])
    train = [r for r in replies if r.metadata.message_type == "train"]
    assert len(train) == 2
    name = "backbone.layer1.0.bn2.running_mean"
    for reply in train:
        tensors = from_array_record(reply.content.array_records[P.ARRAYS])
        assert set(tensors) == set(start)
        assert not torch.equal(tensors[name], start[name])


def test_resources_count_a_resnets_statistics_where_they_travel() -> None:
    """FedPerfix's resource analysis on Table 3's ResNet50 (shapes only, nothing downloaded):
    FedAvg sends every weight and statistic of the ResNet and its head; FedBN keeps the batch
    norms' weights and statistics home: 2 x 2 tensors of its width per BatchNorm."""
    import timm

    from fedfm_flower.study.resources import main

    with torch.device("meta"):
        resnet = timm.create_model("resnet50", pretrained=False, num_classes=0)
    weights = sum(p.numel() for p in resnet.parameters()) + 2048 * 100 + 100
    norms = sum(4 * m.num_features for m in _norms(resnet).values())
    rows = resources_rows(main, ["fedavg", "fedperfix:fedbn-resnet"])
    assert rows["fedavg"] == weights + norms // 2  # + running_mean and running_var
    assert rows["fedperfix:fedbn-resnet"] == weights + norms // 2 - norms


def resources_rows(main, labels: list[str]) -> dict[str, int]:  # noqa: ANN001
    """Uploaded parameters per row of the resources command's CSV on cifar100-dir0.1-resnet50."""
    import contextlib
    import csv
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            ["--setup", "cifar100-dir0.1-resnet50", "--methods", *labels, "--format", "csv"]
        )
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out.getvalue())))
    return {r["label"]: int(r["upload_params"]) for r in rows}


def test_a_timm_resnet_loads_pretrained_weights_and_statistics_from_a_local_file(
    tmp_path: Path,
) -> None:
    """``weights-file`` (timm's pretrained_cfg_overlay): every weight and BatchNorm statistic
    of the file, the file's classifier dropped for the run's head."""
    import timm
    from safetensors.torch import save_file

    from fedfm_flower.models.classifier import vision_backbone

    torch.manual_seed(123)
    source = timm.create_model("resnet18", pretrained=False, num_classes=10)
    with torch.no_grad():
        for module in _norms(source).values():
            module.running_mean.uniform_(-1, 1)  # statistics a file would hold, not the inits
            module.running_var.uniform_(0.5, 2)
    weights = tmp_path / "resnet18.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(weights))
    config = ExperimentConfig(
        method="fedavg",
        tuner="none",
        backbone="resnet18",
        image_size=32,
        pretrained=True,
        weights_file=str(weights),
    )
    backbone = vision_backbone(config)
    loaded = backbone.state_dict()
    assert backbone.num_features == 512
    for name, tensor in source.state_dict().items():
        if not name.startswith("fc."):
            assert torch.equal(loaded[name], tensor), name
