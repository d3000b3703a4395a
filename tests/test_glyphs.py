"""The glyph-domains benchmark: deterministic generation, distinct domains, disjoint splits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data import glyphs
from fedfm_flower.data.federated import client_sample_ids, public_sample_ids
from fedfm_flower.data.partition import partition_plan
from fedfm_flower.data.settings import DataSettings

SMALL = glyphs.GlyphSizes(per_domain=30, public_per_domain=20)


@pytest.fixture(scope="module")
def small() -> glyphs.GlyphArrays:
    """A small generation (every domain, both pools)."""
    return glyphs.generate(SMALL)


def test_generation_is_deterministic_and_shaped(small: glyphs.GlyphArrays, monkeypatch) -> None:
    again = glyphs.generate(SMALL)
    assert again.digest() == small.digest()
    assert small.images.shape == (6 * 30 + 3 * 20, 32, 32, 3) and small.images.dtype == np.uint8
    assert set(small.labels.tolist()) == set(range(10))
    # the public pool holds only the public domains; the clients' pool holds every domain
    public_domains = {glyphs.DOMAINS[d] for d in small.domains[small.public]}
    assert public_domains == set(glyphs.PUBLIC_DOMAINS)
    assert set(small.domains[~small.public].tolist()) == set(range(len(glyphs.DOMAINS)))
    # the pixels come from the generator seed alone: another seed, other pixels
    monkeypatch.setattr(glyphs, "GENERATOR_SEED", glyphs.GENERATOR_SEED + 1)
    assert glyphs.generate(SMALL).digest() != small.digest()


def _statistics(images: np.ndarray) -> np.ndarray:
    """[brightness, saturation, high-frequency energy] averaged over images in [0, 1]."""
    x = images.astype(np.float64) / 255.0
    brightness = x.mean()
    saturation = (x.max(axis=-1) - x.min(axis=-1)).mean()
    gray = x.mean(axis=-1)
    laplacian = 4 * gray[:, 1:-1, 1:-1] - (
        gray[:, :-2, 1:-1] + gray[:, 2:, 1:-1] + gray[:, 1:-1, :-2] + gray[:, 1:-1, 2:]
    )
    return np.array([brightness, saturation, np.abs(laplacian).mean()])


def test_domains_differ_measurably(small: glyphs.GlyphArrays) -> None:
    stats = {
        name: _statistics(small.images[(small.domains == d) & ~small.public])
        for d, name in enumerate(glyphs.DOMAINS)
    }
    names = list(stats)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            gap = np.abs(stats[a] - stats[b]).max()
            assert gap > 0.03, f"domains {a} and {b} look alike: {stats[a]} vs {stats[b]}"
    assert min(stats, key=lambda n: stats[n][0]) == "noisy-blur"  # darkest
    assert max(stats, key=lambda n: stats[n][0]) == "sketch"  # white paper, thin lines
    assert max(stats, key=lambda n: stats[n][1]) == "painting"  # most saturated
    assert max(stats, key=lambda n: stats[n][2]) == "noisy-blur"  # sensor noise
    assert stats["handwriting"][1] > stats["print"][1]  # blue ink vs black ink


def test_cache_is_verified_and_regenerated_when_damaged(tmp_path: Path) -> None:
    first = glyphs.cached_arrays(tmp_path, SMALL)
    (path,) = (tmp_path / "datasets").glob("glyph-domains-*.npz")
    card = json.loads(path.with_suffix(".json").read_text())
    assert card["sha256"] == first.digest() and card["images"] == len(first.labels)
    assert glyphs.cached_arrays(tmp_path, SMALL).digest() == first.digest()
    path.write_bytes(path.read_bytes()[:1000])  # cut short
    assert glyphs.cached_arrays(tmp_path, SMALL).digest() == first.digest()


def _config(cache_dir: Path, **changes) -> ExperimentConfig:
    base = ExperimentConfig(
        dataset="glyph-domains",
        backbone="small-vit",
        image_size=32,
        cache_dir=str(cache_dir),
        test_fraction=0.7,
    )
    return base.replace(**changes)


def test_public_and_client_splits_are_disjoint(cache_dir: Path) -> None:
    config = _config(cache_dir, partitioner="domain-dirichlet", dirichlet_alpha=0.5)
    arrays = glyphs.cached_arrays(cache_dir)
    train, test = public_sample_ids(config)
    public = np.concatenate([train, test])
    assert np.array_equal(np.sort(public), np.flatnonzero(arrays.public))
    assert len(np.intersect1d(train, test)) == 0
    held: list[np.ndarray] = []
    for p in range(12):
        ids = client_sample_ids(config, p, 12)
        for a, b in ((ids.train, ids.test), (ids.train, ids.val), (ids.test, ids.val)):
            assert len(np.intersect1d(a, b)) == 0
        client = np.concatenate([ids.train, ids.test, ids.val])
        assert len(np.intersect1d(client, public)) == 0
        # domain-dirichlet: client p holds only domain sorted(DOMAINS)[p % 6]
        assert {glyphs.DOMAINS[d] for d in arrays.domains[client]} == {
            sorted(glyphs.DOMAINS)[p % 6]
        }
        held.append(client)
    everything = np.concatenate(held)
    assert len(np.unique(everything)) == len(everything)  # no sample held twice
    assert np.array_equal(np.sort(everything), np.flatnonzero(~arrays.public))  # all held
    plan = partition_plan(DataSettings.from_config(config), 12)
    assert plan.natural_ids == tuple(sorted(glyphs.DOMAINS)[p % 6] for p in range(12))


def test_feature_skew_gives_one_domain_per_client_with_500_test_images(cache_dir: Path) -> None:
    config = _config(cache_dir, partitioner="natural-id", test_fraction=0.8)
    arrays = glyphs.cached_arrays(cache_dir)
    for p in range(6):
        ids = client_sample_ids(config, p, 6)
        assert len(ids.test) >= 500
        assert len(set(arrays.domains[ids.test].tolist())) == 1


def test_domain_dirichlet_refuses_fewer_clients_than_domains(cache_dir: Path) -> None:
    config = _config(cache_dir, partitioner="domain-dirichlet")
    with pytest.raises(ValueError, match="at least one client per domain"):
        partition_plan(DataSettings.from_config(config), 4)


def test_small_vit_has_a_conv_stem_and_its_own_foundation_key(tmp_path: Path) -> None:
    import torch

    from fedfm_flower.models.build import build_model
    from fedfm_flower.models.foundation import foundation_key, foundation_path

    config = _config(tmp_path, pretrained=False)
    model = build_model(config, "lora", num_outputs=10)
    embed = model.backbone.patch_embed.proj
    strides = [m.stride[0] for m in embed if isinstance(m, torch.nn.Conv2d)]
    assert strides == [2, 2, 2]  # 32 px -> 16 -> 8 -> a 4x4 grid of 8-pixel patches
    assert not any("Norm2d" in type(m).__name__ for m in model.modules())  # no running stats
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert any(".qkv.lora_A" in name for name, _ in model.named_parameters())
    tiny = config.replace(backbone="tiny-vit")
    assert foundation_key(tiny) != foundation_key(config)
    assert foundation_path(config).name.startswith("small-vit-")
    with pytest.raises(ValueError, match="'vit_small_patch16_224' has no offline foundation"):
        foundation_key(config.replace(backbone="vit_small_patch16_224"))


def test_the_offline_vit_is_pretrained_at_the_data_seed(tmp_path: Path) -> None:
    """A tuned table's final run at seed 1 on data seed 0 runs on data seed 0's foundation (the
    one its trials were tuned on), as tiny-llama does; seeds of their own data keep their own,
    and the key of a run without data-seed is the one it always had."""
    import hashlib

    from fedfm_flower.models.backbones import OFFLINE_VITS
    from fedfm_flower.models.foundation import FOUNDATION_VERSION, foundation_key

    config = _config(tmp_path)
    final = config.replace(seed=1, data_seed=0)
    assert foundation_key(final) == foundation_key(config.replace(seed=0, data_seed=0))
    assert foundation_key(final) == foundation_key(config.replace(seed=0))
    assert foundation_key(config.replace(seed=1)) != foundation_key(config.replace(seed=0))
    fields = {  # the recipe's fields, hashed as before data-seed existed
        "version": FOUNDATION_VERSION,
        "arch": dataclasses.asdict(OFFLINE_VITS[config.backbone]),
        "image_size": config.image_size,
        "dataset": config.dataset,
        "public_fraction": config.public_fraction,
        "epochs": config.pretrain_epochs,
        "seed": 1,
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    assert foundation_key(config.replace(seed=1)) == digest


def test_domain_dirichlet_draws_each_seed_independently(cache_dir: Path) -> None:
    sizes = []
    for seed in (0, 1):
        config = _config(cache_dir, partitioner="domain-dirichlet", dirichlet_alpha=0.5, seed=seed)
        plan = partition_plan(DataSettings.from_config(config), 12)
        sizes.append(sorted(len(p) for p in plan.partitions))
    assert sizes[0] != sizes[1]  # not the same proportions dealt to other domains
