"""pFedPG: visual prompts in the ViT, the prompt generator and its server step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fedfm_flower.config.experiment import ConfigError, ExperimentConfig
from fedfm_flower.learners.pfedpg import PFedPGServer, PFedPGSettings
from fedfm_flower.methods.pfedpg import GENERATORS, QUERIES
from fedfm_flower.models import backbone_fingerprint, build_model
from fedfm_flower.models.backbones import tiny_vit
from fedfm_flower.models.tuners.prompts import VisualPrompts
from fedfm_flower.tasks.training import train

K, WIDTH, N = 3, 8, 4


def backbone() -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_vit(ExperimentConfig(image_size=16))
    return model.eval()


def images(count: int = 2) -> torch.Tensor:
    return torch.randn(count, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def test_bad_settings_fail_in_the_settings_and_the_config() -> None:
    with pytest.raises(ConfigError, match="'pfedpg-generator' = 'film' is invalid: allowed: cross"):
        PFedPGSettings(generator="film")
    with pytest.raises(ConfigError, match="'pfedpg-generator'"):
        ExperimentConfig().replace(pfedpg_generator="film")
    with pytest.raises(ConfigError, match="'pfedpg-query'"):
        ExperimentConfig.from_run_config({"pfedpg-query": "multi"})
    with pytest.raises(ConfigError, match="'pfedpg-attention-dim'"):
        PFedPGSettings(attention_dim=-1)
    with pytest.raises(ConfigError, match="vpt-num-prompts"):
        ExperimentConfig(vpt_num_prompts=0).validate()


# ---------------------------------------------------------------- prompts in the ViT
@pytest.mark.parametrize("deep", [False, True])
def test_prompt_tokens_sit_at_positions_1_to_k(deep: bool) -> None:
    vit = backbone()
    prompts = VisualPrompts(vit, num_prompts=K, deep=deep)
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, a: seen.append(a[0])) for b in vit.blocks]
    with torch.no_grad():
        prompts.features(vit, images())
        plain = vit._pos_embed(vit.patch_embed(images()))
    for hook in hooks:
        hook.remove()
    first = seen[0]
    assert first.shape[1] == plain.shape[1] + K
    torch.testing.assert_close(first[:, 0], plain[:, 0])  # class token + its position embedding
    torch.testing.assert_close(first[:, 1 : K + 1], prompts.embeddings[0].expand(2, -1, -1))
    torch.testing.assert_close(first[:, K + 1 :], plain[:, 1:])  # patches keep their positions
    if deep:  # every later block gets its own prompts in the same slots
        for index in range(1, len(vit.blocks)):
            torch.testing.assert_close(
                seen[index][:, 1 : K + 1], prompts.embeddings[index].expand(2, -1, -1)
            )


@pytest.mark.parametrize("deep", [False, True])
def test_without_prompts_the_output_is_the_plain_vit(deep: bool) -> None:
    vit = backbone()
    with torch.no_grad():
        plain = vit(images())
        prompted = VisualPrompts(vit, num_prompts=0, deep=deep).features(vit, images())
    torch.testing.assert_close(prompted, plain, rtol=0, atol=1e-6)
    with torch.no_grad():
        different = VisualPrompts(vit, num_prompts=K, deep=deep).features(vit, images())
    assert not torch.allclose(different, plain)


@pytest.mark.parametrize("method", ["fedvpt", "fedvpt-deep", "pfedpg"])
def test_prompt_training_leaves_the_backbone_bit_identical(method: str) -> None:
    config = ExperimentConfig(method=method, pretrained=False, local_steps=3, local_epochs=0)
    from fedfm_flower.methods.registry import method_spec
    from fedfm_flower.tasks.classification import ImageClassification

    model = build_model(config, method_spec(method).tuner, 10, load_weights=False)
    before = backbone_fingerprint(model.backbone)
    prompts_before = model.prompts.embeddings.detach().clone()
    assert set(model.group_parameters(["prompt"])) == {"prompts.embeddings"}
    assert not model.group_parameters(["adapter"])
    data = torch.utils.data.TensorDataset(images(32), torch.randint(0, 10, (32,)))
    params = model.group_parameters(["prompt", "head"]).values()
    train(ImageClassification(), model, data, params, config, seed=0)
    assert backbone_fingerprint(model.backbone) == before
    assert not torch.equal(model.prompts.embeddings, prompts_before)


# ---------------------------------------------------------------- the generator
def initial_prompts() -> torch.Tensor:
    return torch.randn(K, WIDTH, generator=torch.Generator().manual_seed(3)) * 0.2


def make_server(generator: str = "cross-attention", query: str = "per-prompt", lr=1e-2):
    settings = PFedPGSettings(generator=generator, query=query, lr=lr, hidden=16)
    return PFedPGServer(settings, initial_prompts(), N, seed=0)


def randomize(server: PFedPGServer) -> None:
    """Zero-initialised output maps hide errors in everything before them; make them non-zero."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in server.generator.named_parameters():
            if name.startswith(("out.", "mlp.4.", "gamma.", "beta.")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def deltas(seed: int, clients) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return {c: torch.randn(K, WIDTH, generator=g) * 1e-2 for c in clients}


@pytest.mark.parametrize("query", QUERIES)
def test_generator_is_the_hand_written_cross_attention_eq3(query: str) -> None:
    server = make_server(query=query)
    randomize(server)
    g = server.generator
    w = {n: p.detach().numpy().astype(np.float64) for n, p in g.named_parameters()}
    base, d = w["base"], w["descriptors.2"]
    q = d @ w["query.weight"].T
    k = base @ w["key.weight"].T
    v = base @ w["value.weight"].T
    logits = q @ k.T / np.sqrt(k.shape[1])
    attention = np.exp(logits - logits.max(1, keepdims=True))
    attention /= attention.sum(1, keepdims=True)
    want = base + attention @ v @ w["out.weight"].T
    got = server.prompts_for(2).numpy()
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-5, atol=1e-6)
    shift = got - base
    if query == "single":  # one query vector: every prompt shifted by the same vector
        np.testing.assert_allclose(shift, np.broadcast_to(shift[0], shift.shape), atol=1e-6)
    else:
        assert not np.allclose(shift[0], shift[1])


@pytest.mark.parametrize("generator", GENERATORS)
def test_every_generator_starts_at_the_basis(generator: str) -> None:
    server = make_server(generator)
    for client in range(N):
        torch.testing.assert_close(server.prompts_for(client), initial_prompts())


@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("reporting", [[1], [0, 2, 3]])
def test_one_small_step_moves_generated_prompts_towards_the_trained_ones(generator, reporting):
    server = make_server(generator, lr=1e-4)
    for t in range(3):  # some history, so Adam has momentum and the output maps are non-zero
        server.step(deltas(t, range(N)))
    randomize(server)
    before = {c: server.prompts_for(c) for c in range(N)}
    updates = deltas(9, reporting)
    server.step(updates)
    gains = {c: float(((server.prompts_for(c) - before[c]) * updates[c]).sum()) for c in reporting}
    assert sum(gains.values()) > 0, gains
    if len(reporting) == 1 or generator != "basis":
        assert all(g > 0 for g in gains.values()), gains


def test_non_reporting_descriptors_do_not_move() -> None:
    server = make_server()
    randomize(server)
    for t in range(3):  # every client reports: all descriptors get Adam momentum
        server.step(deltas(t, range(N)))
    descriptors = [d.detach().clone() for d in server.generator.descriptors]
    base = server.generator.base.detach().clone()
    server.step(deltas(5, [0, 2]))
    after = server.generator.descriptors
    assert torch.equal(after[1], descriptors[1]) and torch.equal(after[3], descriptors[3])
    assert not torch.equal(after[0], descriptors[0]) and not torch.equal(after[2], descriptors[2])
    assert not torch.equal(server.generator.base, base)  # shared parts move


def test_surrogate_gradient_is_the_eq4_vector_jacobian_product() -> None:
    server = make_server()
    randomize(server)
    updates = deltas(1, [0, 3])
    server.accumulate_surrogate_gradient(updates)
    params = list(server.generator.parameters())
    got = [p.grad for p in params]
    outputs = torch.cat([server.generator(c).expand(K, WIDTH) for c in updates])
    grads = torch.autograd.grad(
        outputs, params, grad_outputs=torch.cat(list(updates.values())), allow_unused=True
    )
    for a, b in zip(got, grads, strict=True):
        if b is None:
            assert a is None  # descriptors of clients 1 and 2
        else:
            torch.testing.assert_close(a, -b)


@pytest.mark.parametrize("generator", GENERATORS)
def test_checkpoint_and_resume_are_exact(generator: str, tmp_path) -> None:
    full = make_server(generator)
    for t in range(6):
        full.step(deltas(t, [c for c in range(N) if (c + t) % 3]))
    first = make_server(generator)
    for t in range(3):
        first.step(deltas(t, [c for c in range(N) if (c + t) % 3]))
    save_file(first.state_tensors(), str(tmp_path / "s.safetensors"))
    resumed = make_server(generator)
    resumed.load_state_tensors(load_file(str(tmp_path / "s.safetensors")))
    for t in range(3, 6):
        resumed.step(deltas(t, [c for c in range(N) if (c + t) % 3]))
    a, b = full.state_tensors(), resumed.state_tensors()
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_client_id_outside_the_descriptors_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="client-id 9 is outside"):
        make_server().prompts_for(9)
