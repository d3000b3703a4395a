"""TAP's multi-modal multi-task model: components and ownership, experts initialised from the
pretrained FFN, the frozen parts unchanged by training, decoders' shapes, greedy generation."""

from __future__ import annotations

import pytest
import torch

from fedfm_flower.config.experiment import ExperimentConfig


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A random small-vit, a random tiny LLaMA and its tokenizer (no pretraining needed)."""
    import os

    from fedfm_flower.models.backbones import offline_vit
    from fedfm_flower.models.causal_lm import tokenizer_of
    from fedfm_flower.models.language.foundation import tiny_llama

    cache = os.environ.get("FEDFM_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("cache"))
    config = ExperimentConfig(
        dataset="glyph-domains",
        backbone="small-vit",
        image_size=32,
        pretrained=False,
        cache_dir=cache,
        pretrain_epochs=2,
    )
    torch.manual_seed(0)
    vit = offline_vit(config).eval()
    tokenizer = tokenizer_of(config.replace(dataset="instructions", backbone="tiny-llama"))
    return vit, tiny_llama(tokenizer, seed=0).eval(), tokenizer


PAIRS = {
    "image-cls": ("classification", ("image",), 10),
    "image-gen": ("image-generation", ("image",), 0),
    "vqa": ("text-generation", ("image", "text"), 0),
    "text-cls": ("classification", ("text",), 5),
    "text-gen": ("text-generation", ("text",), 0),
}


def _model(parts, routing: str = "experts"):  # noqa: ANN001, ANN202
    from fedfm_flower.data.multitask import PairSpec
    from fedfm_flower.models.multimodal import ImageEncoder, MultiModalMultiTask, TextEncoder

    vit, lm, tokenizer = parts
    pairs = {name: PairSpec(*spec) for name, spec in PAIRS.items()}
    torch.manual_seed(1)
    model = MultiModalMultiTask(
        ImageEncoder(vit, 4, 8.0, 0.0),
        TextEncoder(lm, 4, 8.0, 0.0),
        lm.config.hidden_size,
        [vit.blocks[1], vit.blocks[2]],
        vit.norm,
        pairs,
        tokenizer,
        rank=4,
        alpha=8.0,
        dropout=0.0,
        image_size=32,
        routing=routing,
    )
    return model.eval()


def _inputs(batch: int = 3):  # noqa: ANN202
    torch.manual_seed(2)
    images = torch.rand(batch, 3, 32, 32)
    ids = torch.randint(3, 200, (batch, 7))
    mask = torch.ones(batch, 7, dtype=torch.long)
    mask[0, 5:] = 0
    return images, ids, mask


def test_every_component_is_a_named_group_and_owners_get_theirs(parts) -> None:
    model = _model(parts)
    groups = set(model.parameter_groups().values())
    assert {"encoder.image", "encoder.text", "mome.shared", "mote.shared"} <= groups
    assert {"mome.image.expert.vqa", "mome.text.expert.vqa", "mote.vqa.expert.image"} <= groups
    assert {"decoder.image-cls", "decoder.text-generation", "decoder.image-generation"} <= groups
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
    text_only = set(model.components_for(["text-cls"]))
    assert not any("image" in g for g in text_only)
    with pytest.raises(ValueError, match="not in this model"):
        model.components_for(["audio-cls"])


def test_the_standard_backbone_is_the_shared_layers_alone(parts) -> None:
    """mm-backbone-routing = "shared" (TAP's Tables 14-16 baselines): no modality or task layer,
    every pair holds the same backbone, and a token's output is the shared layers' alone,
    computed here through the two shared blocks on their own (LoRA non-zero, so that experts
    would differ from them)."""
    model = _model(parts, "shared")
    groups = set(model.parameter_groups().values())
    assert {g for g in groups if g.startswith(("mome", "mote"))} == {"mome.shared", "mote.shared"}
    for pair in PAIRS:
        backbone = [g for g in model.components_for([pair]) if g.startswith(("mome", "mote"))]
        assert backbone == ["mome.shared", "mote.shared"], pair
    assert model.components_for(["text-cls"]) == (
        "encoder.text",
        "mome.shared",
        "mote.shared",
        "decoder.text-cls",
    )
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(std=0.1)
    images, ids, mask = _inputs()
    target = torch.randint(3, 200, (3, 4))
    with torch.no_grad():
        image = model.image_encoder(images)
        text = model.text_encoder(ids, mask)
        assert model.text_projection is None  # both 128 wide
        image_mask = image.new_ones(image.shape[:2])
        tokens = torch.cat(
            [
                model.mome_shared(image, image_mask, "shared"),
                model.mome_shared(text, mask, "shared"),
            ],
            1,
        )
        joint = torch.cat([image_mask, mask.float()], 1)
        tokens = model.final_norm(model.mote_shared(tokens, joint, "shared"))
        expected = model.decoders["text-generation"](target, tokens, joint)
        torch.testing.assert_close(model("vqa", images, ids, mask, target), expected)


def test_the_shared_backbone_is_for_multimodal_baselines_not_tap() -> None:
    from fedfm_flower.config.experiment import ConfigError

    base = {"dataset": "multitask", "backbone": "mm-offline", "mm-backbone-routing": "shared"}
    assert ExperimentConfig.from_run_config({**base, "method": "feddat"}).mm_backbone_routing
    with pytest.raises(ConfigError, match="mm-backbone-routing.*TAP runs on its modality-task"):
        ExperimentConfig.from_run_config({**base, "method": "tap"})
    with pytest.raises(ConfigError, match="multi-modal backbones only, not 'tiny-vit'"):
        ExperimentConfig.from_run_config({"mm-backbone-routing": "shared"})


def test_a_task_trains_exactly_its_components_and_the_frozen_weights_stay(parts) -> None:
    model = _model(parts)
    images, ids, mask = _inputs()
    groups = model.parameter_groups()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if n not in groups}
    assert frozen and not any(p.requires_grad for n, p in model.named_parameters() if n in frozen)
    for task in PAIRS:
        model.zero_grad(set_to_none=True)
        target = torch.randint(3, 200, (3, 5))
        out = model(task, images, ids, mask, target)
        out.float().square().mean().backward()
        touched = {groups[n] for n, p in model.named_parameters() if p.grad is not None}
        assert touched == set(model.components_for([task])), task
    optimizer = torch.optim.SGD([p for n, p in model.named_parameters() if n in groups], lr=0.1)
    optimizer.step()
    for name, value in frozen.items():
        assert torch.equal(dict(model.named_parameters())[name], value), name


def test_experts_start_as_the_pretrained_block(parts) -> None:
    from fedfm_flower.models.multimodal import ExpertBlock

    vit = parts[0]
    block = vit.blocks[1]
    expert_block = ExpertBlock(block, ["a", "b"], rank=4, alpha=8.0, dropout=0.0).eval()
    x = torch.randn(2, 9, block.norm1.normalized_shape[0])
    mask = torch.ones(2, 9)
    with torch.no_grad():
        expected = block(x)
        torch.testing.assert_close(expert_block(x, mask, "a"), expected)
        torch.testing.assert_close(expert_block(x, mask, ["a"] * 4 + ["b"] * 5), expected)
        expert_block.experts["b"].fc2.lora_b.normal_()
        mixed = expert_block(x, mask, ["a"] * 4 + ["b"] * 5)
    # Token routing: tokens routed to 'a' are untouched by b's update; the others change.
    assert not torch.allclose(mixed[:, 4:], expected[:, 4:])


def test_the_image_encoder_sees_images_as_the_vit_was_pretrained_on_them(parts) -> None:
    """The pairs' images are in [0, 1]; the offline ViT was pretrained on normalize()d ones
    ([-1, 1]). With LoRA at its zero start, the encoder's tokens are the ViT's first block on
    the normalised images, and not on the raw ones."""
    from fedfm_flower.data.images import normalize
    from fedfm_flower.models.multimodal import ImageEncoder

    vit = parts[0]
    encoder = ImageEncoder(vit, 4, 8.0, 0.0).eval()
    images, _, _ = _inputs()

    def vit_first_block(x: torch.Tensor) -> torch.Tensor:
        tokens = vit.patch_embed(x)
        tokens = torch.cat([vit.cls_token.expand(len(x), -1, -1), tokens], 1) + vit.pos_embed
        return vit.blocks[0](tokens)

    with torch.no_grad():
        got = encoder(images)
        torch.testing.assert_close(got, vit_first_block(normalize(images)))
        assert not torch.allclose(got, vit_first_block(images), atol=1e-3)


def test_decoders_shapes_and_greedy_generation(parts) -> None:
    model = _model(parts)
    images, ids, mask = _inputs()
    with torch.no_grad():
        assert model("image-cls", images, None, None).shape == (3, 10)
        assert model("text-cls", None, ids, mask).shape == (3, 5)
        generated = model("image-gen", images, None, None)
        assert generated.shape == (3, 3, 32, 32)
        assert 0.0 <= generated.min() and generated.max() <= 1.0
        vocab = len(model.tokenizer)
        assert model("vqa", images, ids, mask, torch.randint(3, 200, (3, 4))).shape == (3, 4, vocab)
        new = model.generate("text-gen", None, ids, mask, max_new_tokens=6)
    assert new.shape[0] == 3 and new.shape[1] <= 6
    with pytest.raises(ValueError, match="needs images"):
        model("vqa", None, ids, mask, torch.randint(3, 200, (3, 4)))
    with pytest.raises(ValueError, match="does not generate"):
        model.generate("image-cls", images, None, None, 3)


def test_padding_does_not_change_a_rows_output(parts) -> None:
    model = _model(parts)
    images, ids, mask = _inputs()
    with torch.no_grad():
        short = model("text-cls", None, ids[:1, :5], mask[:1, :5])
        padded = model("text-cls", None, ids[:1], mask[:1])  # row 0 is masked from token 5 on
    torch.testing.assert_close(short, padded, atol=1e-5, rtol=1e-5)


def test_component_wise_fedavg_averages_each_tensor_over_its_owners() -> None:
    from fedfm_flower.models import TrainableTensors
    from strategies.fedavg import FedAvgStrategy
    from strategies.parts.context import RunContext
    from strategies.parts.replies import ClientReply

    groups = {"enc.image": "encoder.image", "enc.text": "encoder.text", "shared": "mome.shared"}
    users = {
        "encoder.image": frozenset({"image-cls"}),
        "encoder.text": frozenset({"text-cls"}),
        "mome.shared": frozenset({"image-cls", "text-cls"}),
    }
    initial = TrainableTensors({n: torch.zeros(2) for n in groups}, groups, users)
    holdings = {0: ("image-cls",), 1: ("image-cls",), 2: ("text-cls",)}
    config = ExperimentConfig(method="tap")  # every component shared (TAP's split)
    strategy = FedAvgStrategy(config, initial, RunContext(client_holdings=holdings))
    assert set(strategy.train_payload(0, 1)) == {"enc.image", "shared"}
    assert set(strategy.train_payload(2, 1)) == {"enc.text", "shared"}
    assert set(strategy.reply_spec(2)) == {"enc.text", "shared"}
    # Round 1: clients 0 and 1 report (text encoder: no reporting owner, so it stays).
    replies = [
        ClientReply(
            0, 10, {"enc.image": torch.tensor([1.0, 2.0]), "shared": torch.ones(2)}, 30, {}
        ),
        ClientReply(
            1, 11, {"enc.image": torch.tensor([3.0, 6.0]), "shared": torch.zeros(2)}, 10, {}
        ),
    ]
    strategy.aggregate(1, replies)
    torch.testing.assert_close(strategy.global_tensors["enc.image"], torch.tensor([1.5, 3.0]))
    torch.testing.assert_close(strategy.global_tensors["shared"], torch.full((2,), 0.75))
    torch.testing.assert_close(strategy.global_tensors["enc.text"], torch.zeros(2))
    # Round 2: the text client alone owns its encoder (one owner: its values); the shared
    # layer is averaged over the two that sent it, weighted by examples (eq. 1).
    replies = [
        ClientReply(2, 12, {"enc.text": torch.tensor([4.0, 4.0]), "shared": torch.ones(2)}, 20, {}),
        ClientReply(0, 10, {"enc.image": torch.zeros(2), "shared": torch.zeros(2)}, 60, {}),
    ]
    strategy.aggregate(2, replies)
    torch.testing.assert_close(strategy.global_tensors["enc.text"], torch.tensor([4.0, 4.0]))
    torch.testing.assert_close(strategy.global_tensors["shared"], torch.full((2,), 0.25))
    torch.testing.assert_close(strategy.global_tensors["enc.image"], torch.zeros(2))


def test_only_owned_components_travel_on_the_multitask_federation(
    multitask_run_config: dict,
) -> None:
    from fedfm_flower.data.multitask import client_tasks
    from fedfm_flower.models import build_model
    from fedfm_flower.records import protocol as P
    from fedfm_flower.records.messages import record_names
    from server_apps.inprocess import run_in_process

    config = {**multitask_run_config, "method": "fedavg", "num-server-rounds": 1}
    replies = []

    def keep(client_id, reply):  # noqa: ANN001, ANN202
        replies.append((client_id, reply))
        return reply

    summary, grid = run_in_process(config, 4, keep)
    assert set(summary["final-per-client-task-score"]) == {"0", "1", "2", "3"}
    run = ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **config})
    model = build_model(run, "lora", load_weights=False)
    for message in grid.sent:
        if message.metadata.message_type != "train":
            continue
        client = int(message.content["config"][P.CLIENT_ID])
        owned = set(model.names_for(client_tasks(client, 4)))
        assert set(record_names(message.content.array_records[P.ARRAYS])) == owned
    trained = [(c, r.content.array_records.get(P.ARRAYS)) for c, r in replies]
    trained = [(c, arrays) for c, arrays in trained if arrays is not None]  # not evaluations
    assert len(trained) == 4
    for client, arrays in trained:
        assert set(record_names(arrays)) == set(model.names_for(client_tasks(client, 4)))
    assert set(model.names_for(client_tasks(0, 4))) != set(model.names_for(client_tasks(2, 4)))
