"""FedPerfix's datasets from tiny local copies: OrganAMNIST (MedMNIST .npz), Office-Home (folder).

Each test writes its own small files under ``tmp_path``: nothing is downloaded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data import (
    DATASETS,
    DataUnavailableError,
    client_sample_ids,
    load_client_data,
    load_public_split,
    medmnist,
    num_classes_of,
    public_sample_ids,
)
from fedfm_flower.data.loaders import load_source
from fedfm_flower.data.medmnist import medmnist_file
from fedfm_flower.data.settings import DataSettings
from fedfm_flower.methods.settings import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ORGANS = 11
SPLIT_PER_CLASS = {"train": 4, "val": 1, "test": 1}  # 6 images per class, 66 in all
DOMAINS = ("Art", "Clipart", "Product", "Real World")  # sorted, as the partitioner sorts them
CLASSES = ("Alarm_Clock", "Desk_Lamp", "Trash_Can")
PER_CLASS = 8  # per domain: 24 images, 4 clients of domain-dirichlet each


def write_organamnist(path: Path, side: int = 28, drop: str = "") -> dict[str, np.ndarray]:
    """A tiny MedMNIST-style ``.npz`` (11 classes, 6 images each); returns its arrays."""
    rng = np.random.default_rng(side)
    arrays = {}
    for split, per_class in SPLIT_PER_CLASS.items():
        labels = np.repeat(np.arange(ORGANS), per_class)[:, None]  # [N, 1], as MedMNIST's
        arrays[f"{split}_images"] = rng.integers(0, 256, (len(labels), side, side), np.uint8)
        arrays[f"{split}_labels"] = labels
    arrays.pop(drop, None)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return arrays


def write_office_home(root: Path) -> Path:
    """A tiny Office-Home folder: <root>/<domain>/<class>/<image>.jpg, and its extra files."""
    rng = np.random.default_rng(0)
    for domain in DOMAINS:
        for name in CLASSES:
            folder = root / domain / name
            folder.mkdir(parents=True)
            for i in range(PER_CLASS):
                pixels = rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i + 1:05d}.png")
    (root / "ImageInfo.csv").write_text("image,author\n")  # shipped beside the domains
    (root / "imagelist.txt").write_text("Art/Alarm_Clock/00001.png\n")
    return root


def config(**changes: object) -> ExperimentConfig:
    """The default experiment with some fields changed (validated, as from a run config)."""
    made = ExperimentConfig().replace(**changes)
    made.validate()
    return made


def test_registry_lists_both() -> None:
    assert {"organamnist", "office-home"} <= set(DATASETS)  # so the config accepts them
    assert DATASETS["organamnist"].num_classes == 11
    assert DATASETS["office-home"].num_classes == 65
    assert DATASETS["office-home"].natural_id_column == "domain"


def test_organamnist_pools_splits_and_replicates_gray(tmp_path: Path) -> None:
    arrays = write_organamnist(tmp_path / "medmnist" / "organamnist.npz")
    made = config(
        dataset="organamnist",
        data_dir=str(tmp_path / "medmnist"),
        cache_dir=str(tmp_path / "cache"),
        image_size=28,
    )
    assert num_classes_of(made) == ORGANS
    source = load_source(DataSettings.from_config(made))
    labels = np.concatenate([arrays[f"{s}_labels"][:, 0] for s in ("train", "val", "test")])
    assert np.array_equal(source.labels, labels)  # train, val, test in that order
    images = np.concatenate([arrays[f"{s}_images"] for s in ("train", "val", "test")])
    ids = np.array([65, 0, 44, 50, 0])  # any order, repeats: a test-split and a val-split image
    pixels = source.images(ids)
    assert pixels.shape == (5, 3, 28, 28)
    expected = torch.from_numpy(images[ids]).float() / 255.0
    for channel in range(3):  # gray replicated to RGB, untouched at its own size
        assert torch.equal(pixels[:, channel], expected)
    (cached,) = (tmp_path / "cache" / "datasets" / "medmnist").glob("organamnist-*.npy")
    cached.write_bytes(cached.read_bytes()[:200])  # a cut-off cache is rewritten
    medmnist._pooled_images.cache_clear()
    assert torch.equal(source.images(ids), pixels)
    assert cached.stat().st_size > 66 * 28 * 28


def test_organamnist_dirichlet_clients_through_load_client_data(tmp_path: Path) -> None:
    write_organamnist(tmp_path / "organamnist.npz")
    made = config(
        dataset="organamnist",
        data_dir=str(tmp_path),
        cache_dir=str(tmp_path / "cache"),
        partitioner="dirichlet",
        dirichlet_alpha=0.5,
        public_fraction=0.2,
    )
    held = []
    for p in range(4):
        data = load_client_data(made, p, 4)
        images, labels = data.train.tensors
        assert images.shape[1:] == (3, 16, 16) and images.dtype == torch.float32
        assert -1.0 <= images.min() and images.max() <= 1.0
        assert torch.equal(images[:, 0], images[:, 2])  # gray became RGB
        assert data.num_classes == ORGANS and int(labels.max()) < ORGANS
        ids = client_sample_ids(made, p, 4)
        held.append(np.concatenate([ids.train, ids.test]))
    public = np.concatenate(public_sample_ids(made))
    everything = np.concatenate([*held, public])
    assert len(everything) == len(set(everything.tolist())) == 66  # disjoint and covering
    train, test, num_classes = load_public_split(made)
    assert len(train) + len(test) == len(public) and num_classes == ORGANS


def test_organamnist_224_file_named_directly(tmp_path: Path) -> None:
    file = tmp_path / "organamnist_224.npz"
    arrays = write_organamnist(file, side=224)
    made = config(
        dataset="organamnist",
        data_dir=str(file),  # the file itself, not its folder
        cache_dir=str(tmp_path / "cache"),
        image_size=224,
        partitioner="iid",
    )
    source = load_source(DataSettings.from_config(made))
    assert len(source) == 66 and source.num_classes == ORGANS
    expected = torch.from_numpy(arrays["train_images"][3]).float() / 255.0
    assert torch.equal(source.images(np.array([3]))[0, 1], expected)
    assert load_client_data(made, 1, 2).train.tensors[0].shape[1:] == (3, 224, 224)


def test_organamnist_folder_with_two_sizes_reads_the_one_that_fits(tmp_path: Path) -> None:
    write_organamnist(tmp_path / "organamnist.npz", side=28)
    write_organamnist(tmp_path / "organamnist_224.npz", side=224)
    for image_size, name in ((16, "organamnist.npz"), (28, "organamnist.npz")):
        assert medmnist_file("organamnist", str(tmp_path), image_size).name == name
    for image_size in (64, 224, 384):  # the smallest at least image-size, else the largest
        assert medmnist_file("organamnist", str(tmp_path), image_size).name == (
            "organamnist_224.npz"
        )


def test_organamnist_missing_file_or_key_names_the_path(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    made = config(dataset="organamnist", data_dir=str(empty), cache_dir=str(tmp_path / "c"))
    missing = re.escape(f"'{empty}' holds no MedMNIST file organamnist.npz")
    with pytest.raises(DataUnavailableError, match=missing):
        num_classes_of(made)
    with pytest.raises(DataUnavailableError, match="data-dir"):  # no data-dir at all
        load_client_data(config(dataset="organamnist", cache_dir=str(tmp_path / "c")), 0, 2)

    broken = tmp_path / "broken" / "organamnist.npz"
    write_organamnist(broken, drop="val_labels")
    made = made.replace(data_dir=str(broken.parent))
    lacks = re.escape(f"'{broken}' lacks the key(s) val_labels")
    with pytest.raises(DataUnavailableError, match=lacks):
        load_client_data(made, 0, 2)

    with pytest.raises(ConfigError, match="no such directory or file"):
        config(dataset="organamnist", data_dir=str(tmp_path / "nowhere.npz"))
    with pytest.raises(ConfigError, match="no such directory"):  # a file only for MedMNIST
        config(dataset="office-home", data_dir=str(broken))


def test_office_home_domain_dirichlet_one_domain_per_client(tmp_path: Path) -> None:
    made = config(
        dataset="office-home",
        data_dir=str(write_office_home(tmp_path / "OfficeHomeDataset_10072016")),
        cache_dir=str(tmp_path / "cache"),
        partitioner="domain-dirichlet",
        dirichlet_alpha=1.0,
        public_fraction=0.1,
        image_size=12,
    )
    assert num_classes_of(made) == len(CLASSES)  # 65 in the real folder: classes are counted
    source = load_source(DataSettings.from_config(made))
    assert len(source) == len(DOMAINS) * len(CLASSES) * PER_CLASS
    assert sorted(set(source.natural_ids.tolist())) == list(DOMAINS)  # <domain>/<class>/<image>
    clients = 16  # FedPerfix: each of the 4 domains over 4 clients
    held = {}
    for p in range(clients):
        data = load_client_data(made, p, clients)
        assert data.train.tensors[0].shape[1:] == (3, 12, 12) and data.num_classes == 3
        ids = client_sample_ids(made, p, clients)
        held[p] = np.concatenate([ids.train, ids.test])
        assert set(source.natural_ids[held[p]].tolist()) == {DOMAINS[p % 4]}  # one domain each
    for domain_index, domain in enumerate(DOMAINS):  # p, p + 4, p + 8, p + 12 share a domain
        sharing = [held[p] for p in range(domain_index, clients, 4)]
        union = np.concatenate(sharing)
        public = np.concatenate(public_sample_ids(made))
        in_domain = np.flatnonzero(source.natural_ids == domain)
        assert len(union) == len(set(union.tolist()))  # disjoint
        assert sorted(union.tolist()) == sorted(set(in_domain.tolist()) - set(public.tolist()))


def test_office_home_needs_data_dir(tmp_path: Path) -> None:
    made = config(dataset="office-home", partitioner="domain-dirichlet", cache_dir=str(tmp_path))
    with pytest.raises(DataUnavailableError, match="data-dir"):
        load_client_data(made, 0, 4)
