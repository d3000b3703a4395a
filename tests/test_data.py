"""Data: partitions, public split, client splits, feature skew and loaders, all offline.

Sample identity is tracked by sample id (the position in the source dataset), which
``client_sample_ids``/``public_sample_ids`` expose and ``load_client_data`` is checked against.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedfm_flower.config.experiment import ConfigError, ExperimentConfig
from fedfm_flower.data import (
    DATASETS,
    DOMAINS,
    DataUnavailableError,
    clear_caches,
    client_sample_ids,
    load_client_data,
    load_public_split,
    num_classes_of,
    public_sample_ids,
)
from fedfm_flower.data.digits import digits_arrays, digits_pixels
from fedfm_flower.data.images import normalize
from fedfm_flower.data.loaders import load_source
from fedfm_flower.data.settings import DataSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

NUM_DIGITS = 1797
K = 10


def digits_config(**changes: object) -> ExperimentConfig:
    """The default (digits, dirichlet 0.3, 10 clients) experiment with some fields changed."""
    return ExperimentConfig().replace(**changes)


def all_ids(config: ExperimentConfig, num_partitions: int = K) -> list[np.ndarray]:
    """Every id array: each client's train/test/val, then the public train/test."""
    arrays = []
    for p in range(num_partitions):
        ids = client_sample_ids(config, p, num_partitions)
        arrays += [ids.train, ids.test, ids.val]
    return arrays + list(public_sample_ids(config))


def label_histograms(config: ExperimentConfig, num_partitions: int = K) -> np.ndarray:
    """Row p: label counts of client p's whole partition (train + test + val)."""
    _, labels = digits_arrays()
    rows = []
    for p in range(num_partitions):
        ids = client_sample_ids(config, p, num_partitions)
        held = np.concatenate([ids.train, ids.test, ids.val])
        rows.append(np.bincount(labels[held], minlength=10))
    return np.stack(rows)


def test_the_config_allows_exactly_the_registrys_datasets() -> None:
    allowed = f"allowed: {', '.join(DATASETS)}"  # derived from the registry, not a copy
    with pytest.raises(ConfigError, match=re.escape(allowed)):
        ExperimentConfig.from_run_config({"dataset": "mnist"})
    for spec in DATASETS.values():
        # An image-classification dataset read from outside names its classes.
        assert spec.embedded or spec.num_classes > 0 or spec.task != "image-classification"


def test_digits_are_scikit_learns() -> None:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images, labels = digits_arrays()
    assert np.array_equal(labels, bunch.target) and images.shape == (NUM_DIGITS, 8, 8)
    assert torch.equal(images, torch.from_numpy(bunch.images.astype(np.float32) / 16.0))


def test_shapes_dtypes_and_normalization() -> None:
    config = digits_config(image_size=20)
    data = load_client_data(config, 3, K)
    assert data.num_classes == 10 == num_classes_of(config)
    assert data.val is None
    for split in (data.train, data.test):
        images, labels = split.tensors
        assert images.dtype == torch.float32 and labels.dtype == torch.int64
        assert images.shape[1:] == (3, 20, 20) and images.shape[0] == labels.shape[0] > 0
        assert images.min() >= -1.0 and images.max() <= 1.0
        assert images.min() == -1.0 and images.max() == 1.0  # digits span black to white
    ids = client_sample_ids(config, 3, K)
    expected = normalize(digits_pixels(20)[torch.from_numpy(ids.train)])
    assert torch.equal(data.train.tensors[0], expected)
    assert torch.equal(data.train.tensors[1], torch.from_numpy(digits_arrays()[1][ids.train]))
    train, test, num_classes = load_public_split(config)
    assert num_classes == 10 and train.tensors[0].shape[1:] == (3, 20, 20)
    assert len(test) == round(0.2 * (len(train) + len(test)))


def test_default_sizes_and_test_fraction() -> None:
    config = digits_config()
    public = sum(len(ids) for ids in public_sample_ids(config))
    assert public == round(0.3 * NUM_DIGITS)
    for p in range(K):
        data = load_client_data(config, p, K)
        n = len(data.train) + len(data.test)
        assert len(data.test) == round(0.2 * n)


def test_validation_split() -> None:
    config = digits_config(val_fraction=0.1, partitioner="iid")
    data = load_client_data(config, 0, K)
    assert data.val is not None
    n = len(data.train) + len(data.test) + len(data.val)
    assert len(data.val) == round(0.1 * n) and len(data.test) == round(0.2 * n)


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet", "pathological"])
def test_disjoint_and_public_never_held_by_clients(partitioner: str) -> None:
    config = digits_config(partitioner=partitioner, val_fraction=0.1)
    arrays = all_ids(config)
    joined = np.concatenate(arrays)
    assert len(np.unique(joined)) == len(joined), "a sample appears twice"
    public = np.concatenate(public_sample_ids(config))
    clients = np.concatenate(arrays[:-2])
    assert not np.intersect1d(public, clients).size
    if partitioner != "pathological":  # pathological may leave samples unassigned
        assert np.array_equal(np.sort(joined), np.arange(NUM_DIGITS))


def test_same_seed_same_partitions_other_seed_different() -> None:
    first = [ids.copy() for ids in all_ids(digits_config(seed=5))]
    first_images = load_client_data(digits_config(seed=5), 2, K).train.tensors[0].clone()
    clear_caches()
    again = all_ids(digits_config(seed=5))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert torch.equal(first_images, load_client_data(digits_config(seed=5), 2, K).train.tensors[0])
    other = all_ids(digits_config(seed=6))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))
    assert not np.array_equal(first[-1], other[-1])  # the public split moves with the seed too


def mean_tv_distance(histograms: np.ndarray) -> float:
    """Mean total-variation distance of clients' label distributions from the global one."""
    dists = histograms / histograms.sum(axis=1, keepdims=True)
    glob = histograms.sum(axis=0) / histograms.sum()
    return float(0.5 * np.abs(dists - glob).sum(axis=1).mean())


def test_dirichlet_small_alpha_is_skewed_and_iid_is_not() -> None:
    iid = mean_tv_distance(label_histograms(digits_config(partitioner="iid")))
    skewed = mean_tv_distance(label_histograms(digits_config(dirichlet_alpha=0.1)))
    mild = mean_tv_distance(label_histograms(digits_config(dirichlet_alpha=100.0)))
    assert iid < 0.15 and mild < 0.15
    assert skewed > iid + 0.3


def test_pathological_limits_classes_per_client() -> None:
    for classes in (1, 2, 3):
        config = digits_config(partitioner="pathological", classes_per_client=classes)
        histograms = label_histograms(config)
        assert ((histograms > 0).sum(axis=1) <= classes).all()
        for p in range(K):  # first-deterministic: client p surely holds class p mod 10
            assert histograms[p, p % 10] > 0


@pytest.mark.parametrize(("clients", "classes"), [(5, 2), (3, 3), (10, 1)])
def test_disjoint_gives_each_client_every_sample_of_classes_no_other_client_holds(
    clients: int, classes: int
) -> None:
    """Client p's samples are exactly the private samples of its ``classes`` classes, the
    clients' classes do not overlap, leftover classes go to no client, the draw follows the
    seed; more classes than the dataset has are refused, naming the keys."""
    config = digits_config(partitioner="disjoint", classes_per_client=classes, val_fraction=0.1)
    labels = digits_arrays()[1]
    public = np.concatenate(public_sample_ids(config))
    private = np.setdiff1d(np.arange(NUM_DIGITS), public)
    held: list[set[int]] = []
    for p in range(clients):
        ids = client_sample_ids(config, p, clients)
        samples = np.concatenate([ids.train, ids.test, ids.val])
        owned = set(labels[samples].tolist())
        assert len(owned) == classes
        want = private[np.isin(labels[private], sorted(owned))]
        assert np.array_equal(np.sort(samples), np.sort(want)), p
        held.append(owned)
    assert len(set().union(*held)) == clients * classes  # pairwise disjoint
    other = digits_config(partitioner="disjoint", classes_per_client=classes, seed=1)
    drawn = [
        set(labels[client_sample_ids(other, p, clients).train].tolist()) for p in range(clients)
    ]
    assert drawn != held
    with pytest.raises(ValueError, match=r"'disjoint'.*classes-per-client.*need 12 classes"):
        client_sample_ids(digits_config(partitioner="disjoint", classes_per_client=2), 0, 6)


def test_natural_id_gives_one_domain_per_client() -> None:
    config = digits_config(dataset="digits-domains", partitioner="natural-id")
    sizes = []
    for p in range(len(DOMAINS)):
        ids = client_sample_ids(config, p, len(DOMAINS))
        held = np.concatenate([ids.train, ids.test])
        sizes.append(len(held))
        data = load_client_data(config, p, len(DOMAINS))
        raw = digits_pixels(16)[torch.from_numpy(ids.test)]
        assert torch.allclose(data.test.tensors[0], normalize(DOMAINS[p](raw)))
    private = NUM_DIGITS - round(0.3 * NUM_DIGITS)
    assert sum(sizes) == private and max(sizes) - min(sizes) <= 1


def test_natural_id_count_mismatch_is_a_clear_error() -> None:
    config = digits_config(dataset="digits-domains", partitioner="natural-id")
    with pytest.raises(ValueError, match=r"natural-id.*10 values.*num_partitions is 4"):
        load_client_data(config, 0, 4)
    # A dataset without natural ids is refused when the config is built, before any data.
    with pytest.raises(ValueError, match="'tiny-imagenet' has no natural ids"):
        digits_config(dataset="tiny-imagenet", partitioner="natural-id")


def test_bad_partition_id_is_rejected() -> None:
    with pytest.raises(ValueError, match="partition_id"):
        load_client_data(digits_config(), 10, K)


def test_domain_transforms_differ_and_are_deterministic() -> None:
    batch = digits_pixels(16)[:32]
    outputs = [domain(batch) for domain in DOMAINS]
    assert len({domain.name for domain in DOMAINS}) == len(DOMAINS) >= 8
    for i, out in enumerate(outputs):
        assert out.shape == batch.shape and out.min() >= 0 and out.max() <= 1
        assert torch.equal(out, DOMAINS[i](batch.clone()))
        assert torch.equal(out[:5], DOMAINS[i](batch[:5]))  # independent of the batch
        for j in range(i):
            assert (out - outputs[j]).abs().mean() > 0.02, (DOMAINS[i].name, DOMAINS[j].name)


def test_feature_skew_clients_see_their_domain_and_public_stays_clean() -> None:
    config = digits_config(dataset="digits-domains", partitioner="iid")
    plain = digits_config(partitioner="iid")
    for p in (0, 3, 7, 13):
        ids = client_sample_ids(config, p, 14)
        same = client_sample_ids(plain, p, 14)  # same samples as plain digits, other looks
        assert np.array_equal(ids.train, same.train) and np.array_equal(ids.test, same.test)
        data = load_client_data(config, p, 14)
        raw = digits_pixels(16)[torch.from_numpy(ids.train)]
        assert torch.allclose(data.train.tensors[0], normalize(DOMAINS[p % len(DOMAINS)](raw)))
    assert not torch.allclose(
        load_client_data(config, 0, 14).train.tensors[0].mean(),
        load_client_data(config, 3, 14).train.tensors[0].mean(),
    )
    train, _, _ = load_public_split(config)
    public_train, _ = public_sample_ids(config)
    assert torch.equal(train.tensors[0], normalize(digits_pixels(16)[public_train]))
    assert torch.equal(train.tensors[0], load_public_split(plain)[0].tensors[0])


# --- loaders on local files -------------------------------------------------------------------


def _image(rng: np.random.Generator, size: tuple[int, int] = (10, 14)) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.mark.parametrize(("dataset", "label"), [("cifar100", "fine_label"), ("cifar10", "label")])
def test_load_from_disk_dataset_dict(dataset: str, label: str, tmp_path: Path) -> None:
    """A saved DatasetDict with the Hub copy's columns (uoft-cs/cifar100's ``img`` and
    ``fine_label``, uoft-cs/cifar10's ``img`` and ``label``) loads as the dataset's clients."""
    import datasets

    rng = np.random.default_rng(0)
    features = datasets.Features(
        {"img": datasets.Image(), label: datasets.ClassLabel(names=[f"c{i}" for i in range(4)])}
    )

    def split(n: int) -> datasets.Dataset:
        rows = {"img": [_image(rng) for _ in range(n)], label: [i % 4 for i in range(n)]}
        return datasets.Dataset.from_dict(rows, features=features)

    datasets.DatasetDict({"train": split(40), "test": split(20)}).save_to_disk(tmp_path / "c")
    config = digits_config(
        dataset=dataset, data_dir=str(tmp_path / "c"), partitioner="iid", public_fraction=0.2
    )
    assert num_classes_of(config) == 4
    sizes = 0
    for p in range(3):
        data = load_client_data(config, p, 3)
        images = data.train.tensors[0]
        assert images.shape[1:] == (3, 16, 16) and images.dtype == torch.float32
        assert -1.0 <= images.min() and images.max() <= 1.0 and data.num_classes == 4
        sizes += len(data.train) + len(data.test)
    train, test, num_classes = load_public_split(config)
    assert sizes + len(train) + len(test) == 60 and num_classes == 4


def test_load_from_disk_natural_ids_and_top_classes(tmp_path: Path) -> None:
    import datasets

    rng = np.random.default_rng(1)
    domains = ["clipart", "real", "sketch"]
    labels = [c for c in range(12) for _ in range(3 + (c < 10) * 9)]  # classes 10, 11 are rare
    rows = {
        "image": [_image(rng) for _ in labels],
        "label": labels,
        "domain": [domains[i % 3] for i in range(len(labels))],
    }
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "dn")
    config = digits_config(dataset="domainnet", data_dir=str(tmp_path / "dn"), partitioner="iid")
    assert num_classes_of(config) == 10
    config = config.replace(partitioner="natural-id")
    held = 0
    for p in range(3):
        data = load_client_data(config, p, 3)
        assert data.num_classes == 10 and int(data.train.tensors[1].max()) < 10
        held += len(data.train) + len(data.test)
    assert held + sum(len(ids) for ids in public_sample_ids(config)) == 120
    with pytest.raises(ValueError, match="3 values"):
        load_client_data(config, 0, 6)


def test_string_labels_and_gray_images(tmp_path: Path) -> None:
    import datasets

    rng = np.random.default_rng(3)
    alphabets = ["Greek", "Latin", "Bengali"]
    rows = {
        "image": [Image.fromarray(rng.integers(0, 256, (9, 9), dtype=np.uint8)) for _ in range(36)],
        "alphabet": [alphabets[i % 3] for i in range(36)],
        "drawer": [i % 4 for i in range(36)],
    }
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "om")
    config = digits_config(dataset="omniglot", data_dir=str(tmp_path / "om"))
    config = config.replace(partitioner="natural-id", public_fraction=0.25)
    assert num_classes_of(config) == 3
    for p in range(4):
        images, labels = load_client_data(config, p, 4).train.tensors
        assert images.shape[1:] == (3, 16, 16)
        assert torch.equal(images[:, 0], images[:, 2])  # gray became RGB
        assert set(labels.tolist()) <= {0, 1, 2}  # sorted names: Bengali, Greek, Latin


def test_image_folder_with_domain_layout(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    counts = {"amazon": 12, "dslr": 8, "webcam": 10}
    for domain, n in counts.items():
        for i in range(n):
            folder = tmp_path / "oc" / domain / ("bike" if i % 2 else "mug")
            folder.mkdir(parents=True, exist_ok=True)
            _image(rng, (20, 16)).save(folder / f"{i}.png")
    config = digits_config(
        dataset="office-caltech10",
        data_dir=str(tmp_path / "oc"),
        cache_dir=str(tmp_path / "cache"),
        partitioner="natural-id",
        image_size=12,
        public_fraction=0.1,
    )
    assert num_classes_of(config) == 2
    source = load_source(DataSettings.from_config(config))
    assert sorted(set(source.natural_ids)) == sorted(counts)  # from <domain>/<class>/<image>
    public = np.concatenate(public_sample_ids(config))
    assert len(public) == 3
    for p, domain in enumerate(sorted(counts)):  # client p holds the p-th domain, all of it
        data = load_client_data(config, p, 3)
        assert data.train.tensors[0].shape[1:] == (3, 12, 12)
        ids = client_sample_ids(config, p, 3)
        held = np.concatenate([ids.train, ids.test])
        assert set(source.natural_ids[held]) == {domain}
        in_public = int((source.natural_ids[public] == domain).sum())
        assert len(held) + in_public == counts[domain]


def test_missing_hub_access_says_set_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("no internet")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataUnavailableError, match="data-dir"):
        load_client_data(digits_config(dataset="cifar100", partitioner="iid"), 0, 2)
    with pytest.raises(DataUnavailableError, match="data-dir"):
        load_public_split(digits_config(dataset="office-caltech10", partitioner="natural-id"))


def test_digits_upscaled_on_demand_equal_the_whole_set_upscaled() -> None:
    """Each image is resized on its own: upscaling only the asked samples (any order, repeats)
    gives bit-identical pixels to upscaling the whole set and indexing it."""
    ids = np.array([1796, 3, 3, 250, 0, 1024])
    assert torch.equal(digits_pixels(48, ids), digits_pixels(48)[torch.from_numpy(ids)])
    assert digits_pixels(48, ids).shape == (6, 3, 48, 48)


def test_partition_plan_is_cached_on_disk_and_read_back_equal(tmp_path: Path) -> None:
    """The plan is written under cache-dir and a fresh process-level cache reads back exactly
    the computed plan (public ids, every partition, natural ids)."""
    from fedfm_flower.data.partition import partition_plan, plan_cache_path

    for dataset, partitioner, clients in (
        ("digits", "dirichlet", 10),
        ("digits-domains", "natural-id", 10),
    ):
        config = digits_config(
            cache_dir=str(tmp_path), dataset=dataset, partitioner=partitioner, num_clients=clients
        )
        settings = DataSettings.from_config(config)
        clear_caches()
        computed = partition_plan(settings, clients)
        path = plan_cache_path(settings, clients)
        assert path.is_file() and path.parent == tmp_path / "partitions"
        clear_caches()
        read = partition_plan(settings, clients)
        assert read is not computed
        assert np.array_equal(read.public, computed.public)
        assert len(read.partitions) == clients
        for ours, theirs in zip(read.partitions, computed.partitions, strict=True):
            assert ours.dtype == np.int64 and np.array_equal(ours, theirs)
        assert read.natural_ids == computed.natural_ids
        assert (computed.natural_ids is not None) == (partitioner == "natural-id")


def test_partition_cache_key_follows_every_input(tmp_path: Path) -> None:
    """Settings that change the plan change the file; settings that do not, keep it."""
    from fedfm_flower.data.partition import plan_cache_path

    base = digits_config(cache_dir=str(tmp_path))
    key = plan_cache_path(DataSettings.from_config(base), K)
    for change in (
        {"seed": 1},
        {"dirichlet_alpha": 0.5},
        {"partitioner": "iid"},
        {"public_fraction": 0.2},
        {"dataset": "digits-domains"},
    ):
        assert plan_cache_path(DataSettings.from_config(base.replace(**change)), K) != key, change
    assert plan_cache_path(DataSettings.from_config(base), K + 1) != key
    for same in ({"image_size": 32}, {"test_fraction": 0.3}, {"lr": 0.5}):
        assert plan_cache_path(DataSettings.from_config(base.replace(**same)), K) == key, same


def test_unreadable_partition_cache_is_recomputed_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A truncated or foreign file in the cache is logged, recomputed and overwritten."""
    from fedfm_flower.data.partition import partition_plan, plan_cache_path

    settings = DataSettings.from_config(digits_config(cache_dir=str(tmp_path)))
    clear_caches()
    reference = partition_plan(settings, K)
    path = plan_cache_path(settings, K)
    path.write_bytes(path.read_bytes()[:100])
    clear_caches()
    with caplog.at_level("WARNING"):
        again = partition_plan(settings, K)
    assert "unreadable" in caplog.text and str(path) in caplog.text
    assert all(
        np.array_equal(a, b) for a, b in zip(again.partitions, reference.partitions, strict=True)
    )
    assert not list(path.parent.glob("*.tmp"))
    clear_caches()
    caplog.clear()
    with caplog.at_level("WARNING"):
        partition_plan(settings, K)
    assert "unreadable" not in caplog.text  # the file was replaced by a good one


def test_warm_partition_cache_spares_a_fresh_process_the_datasets_imports(tmp_path: Path) -> None:
    """What a ClientApp started per message does: with the plan on disk, loading a client's
    data imports neither ``datasets`` nor ``flwr_datasets``; the data is the same."""
    import subprocess
    import sys

    script = (
        "import sys, json\n"
        "from fedfm_flower.config.experiment import ExperimentConfig\n"
        "from fedfm_flower.data import load_client_data\n"
        f"c = ExperimentConfig().replace(cache_dir={str(tmp_path)!r})\n"
        "d = load_client_data(c, 3, 10)\n"
        "print(json.dumps([sorted(m for m in sys.modules if m.split('.')[0] in "
        "('datasets', 'flwr_datasets'))[:3], d.train.tensors[1].tolist()]))\n"
    )
    runs = [
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    (cold_modules, cold_labels), (warm_modules, warm_labels) = (
        json.loads(r.stdout.strip().splitlines()[-1]) for r in runs
    )
    assert cold_modules  # the first process partitions with flwr-datasets
    assert warm_modules == []
    assert warm_labels == cold_labels


def test_data_seed_fixes_the_data_while_the_seed_varies_the_training() -> None:
    """data-seed = 0 at seed 1 gives every client seed 0's train, test and validation ids; the
    default (-1) follows the seed; with the data drawn per seed, seed 0's validation examples
    land in seed 1's test splits (what the tuning command's final runs must avoid)."""
    trials = digits_config(seed=0, val_fraction=0.05)
    fixed = trials.replace(seed=1, data_seed=0)
    per_seed = trials.replace(seed=1)
    assert fixed.effective_data_seed == 0 and per_seed.effective_data_seed == 1
    leaked = 0
    for p in range(K):
        tuned, final, drawn = (client_sample_ids(c, p, K) for c in (trials, fixed, per_seed))
        for split in ("train", "test", "val"):
            assert np.array_equal(getattr(tuned, split), getattr(final, split)), (p, split)
        leaked += len(np.intersect1d(tuned.val, np.concatenate([
            client_sample_ids(per_seed, q, K).test for q in range(K)
        ])))  # fmt: skip
        assert not np.array_equal(tuned.test, drawn.test)
    assert leaked > 0
    with pytest.raises(ConfigError, match="data-seed"):
        digits_config(data_seed=-2)
