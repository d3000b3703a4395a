"""The parameters a client holds (``fedfm_flower.models.footprint``, TAP's Table 7): hand counts
on a tiny component-wise model, and the ownership of TAP's multi-task model's frozen parts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from fedfm_flower.models.groups import GroupPattern, TunedModel


class Tiny(TunedModel):
    """Two components with their own users, one serving everyone, and a frozen final norm."""

    def __init__(self) -> None:
        super().__init__()
        self.enc_a = nn.ModuleDict({"base": nn.Linear(3, 4), "lora": nn.Linear(4, 2, bias=False)})
        self.enc_b = nn.ModuleDict({"base": nn.Linear(2, 2), "lora": nn.Linear(2, 1)})
        self.shared = nn.ModuleDict({"base": nn.Linear(5, 5), "lora": nn.Linear(1, 1)})
        self.norm = nn.LayerNorm(4).double()  # 8 bytes per element
        for module in (self.enc_a.base, self.enc_b.base, self.shared.base, self.norm):
            module.requires_grad_(False)
        self.group_patterns = (
            GroupPattern("enc.a", r"^enc_a\.lora\."),
            GroupPattern("enc.b", r"^enc_b\.lora\."),
            GroupPattern("shared", r"^shared\.lora\."),
        )

    def group_users(self) -> dict[str, frozenset[str]]:
        """enc.a serves x, enc.b serves y; shared (left out) serves everyone."""
        return {"enc.a": frozenset({"x"}), "enc.b": frozenset({"y"})}


def test_a_frozen_parameter_serves_the_users_of_its_modules_components() -> None:
    from fedfm_flower.models.footprint import frozen_users, held_names

    users = frozen_users(Tiny())
    assert users == {
        "enc_a.base.weight": frozenset({"x"}),
        "enc_a.base.bias": frozenset({"x"}),
        "enc_b.base.weight": frozenset({"y"}),
        "enc_b.base.bias": frozenset({"y"}),
        "shared.base.weight": None,  # its module's component serves everyone
        "shared.base.bias": None,
        "norm.weight": None,  # shares no module with a component
        "norm.bias": None,
    }
    trainable, frozen = held_names(Tiny(), ["x"])
    assert trainable == ["enc_a.lora.weight", "shared.lora.weight", "shared.lora.bias"]
    assert "enc_b.base.weight" not in frozen and "enc_a.base.weight" in frozen


def test_footprint_counts_by_hand_and_tap_holds_the_trainable_part_twice() -> None:
    from fedfm_flower.models.footprint import Footprint, client_footprint

    model = Tiny()
    # Holder of x: trainable enc_a.lora (4*2) + shared.lora (1 + 1) = 10; frozen enc_a.base
    # (3*4 + 4) + shared.base (5*5 + 5) + norm (4 + 4, float64) = 54.
    fedavg = client_footprint(model, ["x"])
    assert fedavg == Footprint(10, 54, 10 * 4, 46 * 4 + 8 * 8)
    assert fedavg.total == 64 and fedavg.trainable_fraction == pytest.approx(10 / 64)
    tap = client_footprint(model, ["x"], copies=1)  # W~ and X
    assert tap == Footprint(20, 54, 20 * 4, 46 * 4 + 8 * 8)
    assert tap.total == 2 * fedavg.trainable + fedavg.frozen == 74
    assert tap.trainable_fraction == pytest.approx(20 / 74)
    assert tap.bytes == fedavg.bytes + fedavg.trainable_bytes
    # Holding both, or nothing named (every part), is the whole model.
    whole = sum(p.numel() for p in model.parameters())
    assert client_footprint(model, ["x", "y"]).total == whole == client_footprint(model, []).total
    with pytest.raises(ValueError):
        fedavg.with_copies(-1)


def test_a_model_without_component_users_is_held_whole() -> None:
    from fedfm_flower.models.footprint import client_footprint

    class Plain(Tiny):
        def group_users(self) -> dict[str, frozenset[str]]:
            return {}

    model = Plain()
    footprint = client_footprint(model, ["x"])
    assert footprint.total == sum(p.numel() for p in model.parameters())
    grouped = model.parameters_named(model.parameter_groups())
    assert footprint.trainable == sum(p.numel() for p in grouped.values())


@pytest.fixture(scope="module")
def multitask_model(tmp_path_factory: pytest.TempPathFactory) -> TunedModel:
    """TAP's ``mm-offline`` model with random weights (only the tokenizer is built)."""
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.models.multimodal import build_multimodal

    cache = os.environ.get("FEDFM_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("cache"))
    config = ExperimentConfig(
        method="tap",
        dataset="multitask",
        backbone="mm-offline",
        image_size=32,
        lora_rank=4,
        pretrained=False,
        pretrain_epochs=2,
        cache_dir=str(Path(cache)),
    )
    torch.manual_seed(0)
    return build_multimodal(config, "lora", 0, load_weights=False)


def test_multitask_clients_hold_their_encoders_layers_and_experts_frozen_parts(
    multitask_model: TunedModel,
) -> None:
    from fedfm_flower.data.multitask import GROUPS, MULTITASK_TASKS
    from fedfm_flower.models.footprint import client_footprint, held_names

    model = multitask_model
    whole = sum(p.numel() for p in model.parameters())
    assert client_footprint(model, MULTITASK_TASKS).total == whole
    _, text_only = held_names(model, ["text-cls", "text-gen"])
    assert not any(n.startswith(("image_encoder.", "mome.image.")) for n in text_only)
    assert "text_encoder.body.embed_tokens.weight" in text_only
    assert "mome_shared.attn.proj.weight" in text_only  # shared layers: every client's
    assert "final_norm.weight" in text_only
    assert "mote.text-cls.experts.text.fc1.base.weight" in text_only
    assert not any(n.startswith("mote.vqa.") for n in text_only)
    _, vqa = held_names(model, ["vqa"])
    assert "mome.image.experts.vqa.fc1.base.weight" in vqa
    assert "mome.image.experts.image-cls.fc1.base.weight" not in vqa
    assert "mome.image.norm1.weight" in vqa  # the image layer's own frozen parts
    # Every group's client holds less than the model; TAP adds exactly one trainable copy.
    for holds in GROUPS:
        fedavg, tap = client_footprint(model, holds), client_footprint(model, holds, copies=1)
        assert fedavg.total < whole
        trainable = model.parameters_named(model.names_for(holds)).values()
        assert tap.total - fedavg.total == fedavg.trainable == sum(p.numel() for p in trainable)
