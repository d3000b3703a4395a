"""TAP's model from FLAVA / ViLT checkpoints (mm-flava, mm-vilt): the checkpoint's frozen weights
where the paper takes them, only LoRA and decoders trainable, the same components as mm-offline,
a loss step per pair kind, layers and encoders that compute what the checkpoint's do, and clear
errors for bad paths. Tiny checkpoints (width 32) written to a temporary directory: no Hub."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedfm_flower.config.experiment import ExperimentConfig

WIDTH = 32
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS += [
    *"abcdefghijklmnopqrstuvwxyz0123456789?.,:",
    *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"),
]
WORDS += ["what", "digit", "is", "shown", "the", "answer", "seven", "two", "even", "odd"]
SMALL = {
    "hidden_size": WIDTH,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 37,
}
FLAVA_LAYERS = 3  # the checkpoint's image/text/multimodal layers (the backbone takes 2)
VILT_LAYERS = 9  # the backbone takes the first 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny FlavaModel and a tiny ViltForMaskedLM (vilt-b32-mlm's class), each saved with a
    tiny BERT tokenizer."""
    from transformers import BertTokenizer, FlavaConfig, FlavaModel

    root = tmp_path_factory.mktemp("checkpoints")
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)})
    torch.manual_seed(0)
    layers = {**SMALL, "num_hidden_layers": FLAVA_LAYERS}
    flava = FlavaModel(
        FlavaConfig(
            text_config={**layers, "vocab_size": len(WORDS), "max_position_embeddings": 64},
            image_config={**layers, "image_size": 64, "patch_size": 16},
            multimodal_config=layers,
            hidden_size=WIDTH,
            projection_dim=16,
        )
    )
    flava.save_pretrained(root / "mm-flava")
    tokenizer.save_pretrained(root / "mm-flava")
    _save_vilt(root / "mm-vilt", VILT_LAYERS)
    return {"mm-flava": root / "mm-flava", "mm-vilt": root / "mm-vilt"}


def _save_vilt(path: Path, layers: int) -> None:
    """A tiny ViltForMaskedLM (vilt-b32-mlm's class) and the tiny tokenizer, at ``path``."""
    from transformers import BertTokenizer, ViltConfig, ViltForMaskedLM

    config = ViltConfig(
        **{**SMALL, "num_hidden_layers": layers},
        vocab_size=len(WORDS),
        max_position_embeddings=40,
        image_size=64,
        patch_size=16,
    )
    ViltForMaskedLM(config).save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)}).save_pretrained(path)


def _config(backbone: str, path: object, **changes: object) -> ExperimentConfig:
    values = {
        "method": "fedavg",
        "dataset": "multitask",
        "backbone": backbone,
        "model-name-or-path": str(path),
        "image-size": 32,
        "max-length": 40,
        "lora-rank": 4,
        **changes,
    }
    return ExperimentConfig.from_run_config(values)


def _build(backbone: str, path: object, *, load_weights: bool = True, **changes: object):  # noqa: ANN202
    from fedfm_flower.models import build_model

    return build_model(_config(backbone, path, **changes), "lora", load_weights=load_weights)


@pytest.fixture(scope="module")
def models(checkpoints: dict[str, Path]) -> dict[str, torch.nn.Module]:
    """mm-flava and mm-vilt built from the tiny checkpoints through the normal builder."""
    return {name: _build(name, path) for name, path in checkpoints.items()}


# Model parameter <- checkpoint tensor: every encoder, every backbone layer the paper takes.
FLAVA_PAIRS = [
    (
        "image_encoder.model.embeddings.patch_embeddings.projection.weight",
        "image_model.embeddings.patch_embeddings.projection.weight",
    ),
    (
        "image_encoder.model.embeddings.position_embeddings",
        "image_model.embeddings.position_embeddings",
    ),
    *(
        (
            f"image_encoder.model.encoder.layer.{i}.attention.attention.query.base.weight",
            f"image_model.encoder.layer.{i}.attention.attention.query.weight",
        )
        for i in range(FLAVA_LAYERS)
    ),
    ("image_encoder.projection.weight", "image_to_mm_projection.weight"),
    (
        "text_encoder.model.embeddings.word_embeddings.weight",
        "text_model.embeddings.word_embeddings.weight",
    ),
    *(
        (
            f"text_encoder.model.encoder.layer.{i}.output.dense.weight",
            f"text_model.encoder.layer.{i}.output.dense.weight",
        )
        for i in range(FLAVA_LAYERS)
    ),
    ("text_encoder.projection.weight", "text_to_mm_projection.weight"),
    (
        "mome.image.attn.query.base.weight",
        "multimodal_model.encoder.layer.0.attention.attention.query.weight",
    ),
    ("mome.text.norm1.weight", "multimodal_model.encoder.layer.0.layernorm_before.weight"),
    (
        "mome.text.experts.vqa.fc1.base.weight",
        "multimodal_model.encoder.layer.0.intermediate.dense.weight",
    ),
    (
        "mome_shared.experts.shared.fc2.base.weight",
        "multimodal_model.encoder.layer.0.output.dense.weight",
    ),
    ("mote.vqa.attn.key.weight", "multimodal_model.encoder.layer.1.attention.attention.key.weight"),
    (
        "mote.vqa.experts.image.fc2.base.weight",
        "multimodal_model.encoder.layer.1.output.dense.weight",
    ),
    (
        "mote_shared.attn.proj.weight",
        "multimodal_model.encoder.layer.1.attention.output.dense.weight",
    ),
    ("final_norm.weight", "multimodal_model.layernorm.weight"),
]
VILT_PAIRS = [
    ("image_encoder.projection.base.weight", "vilt.embeddings.patch_embeddings.projection.weight"),
    ("image_encoder.position_embeddings", "vilt.embeddings.position_embeddings"),
    ("image_encoder.cls_token", "vilt.embeddings.cls_token"),
    ("image_encoder.modality.weight", "vilt.embeddings.token_type_embeddings.weight"),
    (
        "text_encoder.embeddings.word_embeddings.base.weight",
        "vilt.embeddings.text_embeddings.word_embeddings.weight",
    ),
    (
        "text_encoder.embeddings.position_embeddings.weight",
        "vilt.embeddings.text_embeddings.position_embeddings.weight",
    ),
    *(
        (
            f"mome.image.{i}.attn.query.base.weight",
            f"vilt.encoder.layer.{i}.attention.attention.query.weight",
        )
        for i in range(4)
    ),
    *(
        (
            f"mome_shared.{i}.experts.shared.fc1.base.weight",
            f"vilt.encoder.layer.{i}.intermediate.dense.weight",
        )
        for i in range(4)
    ),
    *(
        (
            f"mote.vqa.{i}.experts.text.fc2.base.weight",
            f"vilt.encoder.layer.{i + 4}.output.dense.weight",
        )
        for i in range(4)
    ),
    *(
        (f"mote_shared.{i}.norm2.weight", f"vilt.encoder.layer.{i + 4}.layernorm_after.weight")
        for i in range(4)
    ),
    ("final_norm.weight", "vilt.layernorm.weight"),
]


@pytest.mark.parametrize("backbone", ["mm-flava", "mm-vilt"])
def test_frozen_weights_are_the_checkpoints(backbone: str, checkpoints, models) -> None:  # noqa: ANN001
    saved = load_file(checkpoints[backbone] / "model.safetensors")
    parameters = dict(models[backbone].named_parameters())
    pairs = FLAVA_PAIRS if backbone == "mm-flava" else VILT_PAIRS
    for mine, theirs in pairs:
        assert torch.equal(parameters[mine].detach(), saved[theirs]), (mine, theirs)
        assert not parameters[mine].requires_grad, mine
    if backbone == "mm-vilt":  # the first 8 layers only: no block holds layer 8's weights
        ninth = saved["vilt.encoder.layer.8.intermediate.dense.weight"]
        assert not any(
            p.shape == ninth.shape and torch.equal(p, ninth) for p in parameters.values()
        )


GROUPS = {
    "encoder.image", "encoder.text", "mome.shared", "mote.shared",
    "mome.image.attn", "mome.text.attn",
    "mome.image.expert.image-cls", "mome.image.expert.image-gen", "mome.image.expert.vqa",
    "mome.text.expert.text-cls", "mome.text.expert.text-gen", "mome.text.expert.vqa",
    "mote.image-cls.attn", "mote.image-gen.attn", "mote.vqa.attn", "mote.text-cls.attn",
    "mote.text-gen.attn", "mote.image-cls.expert.image", "mote.image-gen.expert.image",
    "mote.vqa.expert.image", "mote.vqa.expert.text", "mote.text-cls.expert.text",
    "mote.text-gen.expert.text", "decoder.image-cls", "decoder.text-cls",
    "decoder.image-generation", "decoder.text-generation",
}  # fmt: skip


@pytest.mark.parametrize("backbone", ["mm-flava", "mm-vilt"])
def test_only_lora_and_decoders_train_in_mm_offlines_components(
    backbone: str,
    checkpoints,  # noqa: ANN001
    models,  # noqa: ANN001
) -> None:
    model = models[backbone]
    groups = model.parameter_groups()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(groups)
    assert all(re.search(r"\.lora_[ab]$", n) or n.startswith("decoders.") for n in trainable)
    assert set(groups.values()) == GROUPS == set(model.group_users())
    assert model.components_for(["image-cls", "image-gen"]) == (
        "encoder.image",
        "mome.image.attn",
        "mome.image.expert.image-cls",
        "mome.image.expert.image-gen",
        "mome.shared",
        "mote.image-cls.attn",
        "mote.image-cls.expert.image",
        "mote.image-gen.attn",
        "mote.image-gen.expert.image",
        "mote.shared",
        "decoder.image-cls",
        "decoder.image-generation",
    )
    # The server builds without the weights: the same seeded trainable tensors.
    bare = _build(backbone, checkpoints[backbone], load_weights=False)
    loaded, initial = model.trainable().tensors, bare.trainable().tensors
    assert loaded.keys() == initial.keys()
    assert all(torch.equal(loaded[n], initial[n]) for n in loaded)
    name = (FLAVA_PAIRS if backbone == "mm-flava" else VILT_PAIRS)[0][0]  # the patch projection
    assert not torch.equal(
        dict(model.named_parameters())[name], dict(bare.named_parameters())[name]
    )


def _examples(image_size: int) -> list:
    from fedfm_flower.data.multitask import TaskExamples

    torch.manual_seed(3)

    def part(task: str, images: bool, prompts: tuple, labels: object, targets: tuple):  # noqa: ANN202
        n = len(prompts)
        return TaskExamples(
            task,
            tuple(f"{task}:{i}" for i in range(n)),
            torch.rand(n, 3, image_size, image_size) if images else None,
            prompts,
            labels,
            targets,
        )

    return [
        part("image-cls", True, ("",) * 2, np.array([3, 7]), ("",) * 2),
        part("image-gen", True, ("",) * 2, None, ("",) * 2),
        part("vqa", True, ("what digit is shown?", "is the digit even?"), None, ("seven", "odd")),
        part("text-cls", False, ("what is the answer?", "the digit"), np.array([1, 4]), ("",) * 2),
        part("text-gen", False, ("digit: 7", "digit: 2, even"), None, ("seven", "two is even")),
    ]


@pytest.mark.parametrize("backbone", ["mm-flava", "mm-vilt"])
def test_a_loss_step_runs_for_every_pair_kind(backbone: str, checkpoints, models) -> None:  # noqa: ANN001
    from fedfm_flower.data.multitask import MULTITASK_TASKS
    from fedfm_flower.tasks import multitask as mtask

    config = _config(backbone, checkpoints[backbone])
    model = models[backbone]
    tokenizer = mtask.text_tokenizer(config)  # what the data is encoded with
    assert tokenizer.get_vocab() == model.tokenizer.get_vocab()
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("[CLS]", "[SEP]")
    data = mtask.encode_examples(tokenizer, _examples(32), 32, config.max_length)
    batch = next(mtask.multitask_batches(data, 10, None))
    model.train()
    model.zero_grad(set_to_none=True)
    result = mtask.MultimodalMultitask().step(model, batch)
    assert torch.isfinite(result.loss)
    assert {f"count-{t}" for t in MULTITASK_TASKS} <= set(result.sums)
    result.loss.backward()
    groups = model.parameter_groups()
    touched = {n for n, p in model.named_parameters() if p.grad is not None}
    assert touched and touched <= set(groups)
    assert {groups[n] for n in touched} == GROUPS  # every pair's components took part
    model.eval()
    rows = (batch[0] == MULTITASK_TASKS.index("text-gen")).nonzero().squeeze(1)
    single = tuple(t[rows] for t in batch)
    generated = mtask.generate(model, "text-gen", single, 3)
    assert generated.shape[0] == 2 and generated.shape[1] <= 3
    assert all(isinstance(t, str) for t in mtask.decode_generated(model.tokenizer, generated))


def test_feddats_teacher_branches_every_lora_layer_of_vilt(checkpoints, models) -> None:  # noqa: ANN001
    """FedDAT's DAT on mm-vilt: its LoRA embedding and convolution take A_c as every linear
    LoRA does; with A_c = A_g and weights (0.5, 0.5) the DAT computes the model's own loss."""
    from client_apps.feddat import dual_adapter_teacher, lora_names
    from fedfm_flower.models.multimodal import LoRALayer
    from fedfm_flower.models.multimodal_hf import LoRAConv2d, LoRAEmbedding
    from fedfm_flower.tasks import multitask as mtask

    config = _config("mm-vilt", checkpoints["mm-vilt"])
    model = models["mm-vilt"].eval()
    names = lora_names(model.parameter_groups())
    own = model.parameters_named(names)
    dat = dual_adapter_teacher(model, names, {n: p.detach() for n, p in own.items()}, 0.5)
    layers = [m for m in dat.modules() if isinstance(m, LoRALayer)]
    assert {LoRAEmbedding, LoRAConv2d} <= {type(m) for m in layers}
    assert all(m.branch is not None for m in layers)
    tokenizer = mtask.text_tokenizer(config)
    data = mtask.encode_examples(tokenizer, _examples(32), 32, config.max_length)
    batch = next(mtask.multitask_batches(data, 10, None))
    with torch.no_grad():
        expected = mtask.MultimodalMultitask().step(model, batch).loss
        got = mtask.MultimodalMultitask().step(dat.eval(), batch).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_an_expert_block_of_a_hf_layer_computes_the_layer(checkpoints) -> None:  # noqa: ANN001
    from transformers import FlavaModel, ViltModel

    from fedfm_flower.models.multimodal import ExpertBlock
    from fedfm_flower.models.multimodal_hf import HFBlock

    flava = FlavaModel.from_pretrained(checkpoints["mm-flava"]).eval()
    vilt = ViltModel.from_pretrained(checkpoints["mm-vilt"]).eval()
    torch.manual_seed(4)
    x = torch.randn(2, 7, WIDTH)
    mask = torch.ones(2, 7)
    mask[1, 4:] = 0
    additive = (1.0 - mask)[:, None, None, :] * torch.finfo(torch.float32).min
    for layer in (flava.multimodal_model.encoder.layer[1], vilt.encoder.layer[5]):
        block = ExpertBlock(HFBlock(layer), ["a", "b"], rank=4, alpha=8.0, dropout=0.0).eval()
        with torch.no_grad():
            expected = layer(x, additive)[0]
            torch.testing.assert_close(block(x, mask, "a"), expected, atol=1e-5, rtol=1e-5)
            routed = block(x, mask, ["a"] * 3 + ["b"] * 4)
            torch.testing.assert_close(routed, expected, atol=1e-5, rtol=1e-5)


def test_vilt_image_encoder_is_vilts_patch_embedding(checkpoints, models) -> None:  # noqa: ANN001
    from transformers import ViltModel

    from fedfm_flower.models.multimodal_hf import VILT_IMAGE_TYPE

    vilt = ViltModel.from_pretrained(checkpoints["mm-vilt"]).eval()
    encoder = models["mm-vilt"].image_encoder.eval()
    torch.manual_seed(5)
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        theirs, _, (patch_index, (_, columns)) = vilt.embeddings.visual_embed(
            (images - 0.5) / 0.5, torch.ones(2, 32, 32, dtype=torch.long), max_image_length=-1
        )
        theirs = theirs + vilt.embeddings.token_type_embeddings.weight[VILT_IMAGE_TYPE]
        mine = encoder(images)
    order = (patch_index[..., 0] * columns + patch_index[..., 1]).argsort(1)  # raster order
    theirs = torch.cat(
        [theirs[:, :1], theirs[:, 1:].gather(1, order[..., None].expand_as(theirs[:, 1:]))], 1
    )
    torch.testing.assert_close(mine, theirs)


def test_bad_checkpoints_fail_clearly(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    missing = tmp_path / "no-flava-here"
    with pytest.raises(FileNotFoundError, match=re.escape(f"no FLAVA model at {missing}")):
        _build("mm-flava", missing)
    with pytest.raises(
        ValueError, match="'model-name-or-path' = '' is invalid for backbone 'mm-vilt'"
    ):
        _build("mm-vilt", "")
    with pytest.raises(ValueError, match="holds a 'vilt' model; backbone 'mm-flava' needs a FLAVA"):
        _build("mm-flava", checkpoints["mm-vilt"])
    with pytest.raises(FileNotFoundError, match="'nobody/no-such-flava'"):  # offline, not cached
        _build("mm-flava", "nobody/no-such-flava")
    with pytest.raises(ValueError, match="'image-size' = 40 .* multiple of its patch size, 16"):
        _build("mm-flava", checkpoints["mm-flava"], **{"image-size": 40})
    with pytest.raises(ValueError, match="'max-length' = 96 .* 40 positions"):
        _build("mm-vilt", checkpoints["mm-vilt"], **{"max-length": 96})
    shallow = tmp_path / "shallow-vilt"
    _save_vilt(shallow, layers=7)
    with pytest.raises(
        ValueError, match="first 8 layers of ViLT's transformer, the checkpoint has 7"
    ):
        _build("mm-vilt", shallow)
