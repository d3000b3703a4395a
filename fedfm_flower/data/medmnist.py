"""MedMNIST subsets (OrganAMNIST) from the ``.npz`` files that medmnist.com distributes.

A subset ``<flag>`` comes as ``<flag>.npz`` (28x28) or ``<flag>_{64,128,224}.npz``, each with
the keys ``train_images``, ``train_labels``, ``val_images``, ``val_labels``, ``test_images``
and ``test_labels``: images ``uint8 [N, s, s]`` (grayscale) or ``[N, s, s, 3]``, labels
``int [N, 1]``. ``data-dir`` names the file itself or the folder holding it; where that folder
holds several sizes, the smallest at least ``image-size`` is read (else the largest). The three
splits are pooled (train, val, test, in that order): this package makes its own public, train
and test splits. Gray images become RGB by channel replication, as every gray source does
(``images.pil_to_tensor``), and are resized with PIL's bilinear filter.

The ``.npz`` members are compressed and cannot be memory-mapped, and every message of a
deployed ClientApp starts a fresh process: so the pooled images are written once to an
uncompressed ``.npy`` under ``<cache-dir>/datasets/medmnist`` (keyed by the file's path, size
and modification time) and memory-mapped from there; a process reads only the rows it asks for.
A cache file that cannot be read is rewritten.

Imports inside functions keep ``PIL`` out of this module's start-up.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import zipfile
from pathlib import Path

import numpy as np
import torch

from fedfm_flower.data.images import pil_to_tensor
from fedfm_flower.data.source import DataUnavailableError, Source
from fedfm_flower.records.durable import atomic_path

SPLITS = ("train", "val", "test")
SIZES = (28, 64, 128, 224)  # MedMNIST+ sizes; 28 has no suffix in the file name
CACHE_VERSION = 1  # bump whenever the cached array's layout changes

log = logging.getLogger(__name__)


def medmnist_file(flag: str, data_dir: str, image_size: int) -> Path:
    """The ``.npz`` of subset ``flag`` that ``data-dir`` names (the file, or a folder holding
    it); a DataUnavailableError naming the path when there is none."""
    names = [f"{flag}.npz" if size == 28 else f"{flag}_{size}.npz" for size in SIZES]
    if not data_dir:
        raise DataUnavailableError(
            f"MedMNIST subset '{flag}' has no Hugging Face Hub copy here: download {names[0]} "
            "(or a size variant) from https://medmnist.com and set run config 'data-dir' to the "
            "file or to its folder"
        )
    path = Path(data_dir).expanduser()
    if path.is_file():
        return path
    pairs = zip(SIZES, names, strict=True)
    found = [(size, path / name) for size, name in pairs if (path / name).is_file()]
    if not found:
        raise DataUnavailableError(
            f"data-dir '{path}' holds no MedMNIST file {' or '.join(names)}: download "
            f"{names[0]} (or a size variant) from https://medmnist.com and set data-dir to it "
            "or to its folder"
        )
    large_enough = [(size, file) for size, file in found if size >= image_size]
    _, file = large_enough[0] if large_enough else found[-1]
    if len(found) > 1:
        log.info("data-dir '%s' holds %d sizes of %s; reading %s", path, len(found), flag, file)
    return file


def medmnist_source(name: str, flag: str, data_dir: str, cache_dir: str, image_size: int) -> Source:
    """Subset ``flag`` as the ``Source`` of dataset ``name``: all splits pooled, pixels
    memory-mapped from a cached copy and decoded on demand."""
    file = medmnist_file(flag, data_dir, image_size)
    labels = _pooled_labels(file)
    if labels.size == 0:
        raise DataUnavailableError(f"MedMNIST file '{file}' holds no samples")
    if labels.min() < 0:
        raise DataUnavailableError(f"MedMNIST file '{file}' has negative labels")
    cache = _cache_path(file, Path(cache_dir))

    def pixels(sample_ids: np.ndarray) -> torch.Tensor:
        from PIL import Image

        images = _pooled_images(file, cache)[sample_ids]
        return pil_to_tensor((Image.fromarray(image) for image in images), image_size)

    return Source(
        name=name,
        labels=labels,
        num_classes=int(labels.max()) + 1,
        natural_id_column="",
        natural_ids=None,
        synthetic_domains=0,
        pixels=pixels,
    )


def _open(file: Path) -> np.lib.npyio.NpzFile:
    """The ``.npz`` at ``file`` with every expected key, or a DataUnavailableError naming it."""
    try:
        stored = np.load(file, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DataUnavailableError(
            f"MedMNIST file '{file}' cannot be read as .npz ({type(err).__name__}: {err})"
        ) from err
    if not isinstance(stored, np.lib.npyio.NpzFile):
        raise DataUnavailableError(f"MedMNIST file '{file}' is a single array, not an .npz")
    expected = [f"{split}_{kind}" for split in SPLITS for kind in ("images", "labels")]
    missing = [key for key in expected if key not in stored.files]
    if missing:
        stored.close()
        raise DataUnavailableError(
            f"MedMNIST file '{file}' lacks the key(s) {', '.join(missing)} "
            f"(it has {', '.join(stored.files) or 'none'})"
        )
    return stored


def _pooled_labels(file: Path) -> np.ndarray:
    """int64 labels of the train, val and test splits, in that order."""
    with _open(file) as stored:
        parts = []
        for split in SPLITS:
            labels = stored[f"{split}_labels"]
            if labels.ndim == 2 and labels.shape[1] == 1:
                labels = labels[:, 0]
            if labels.ndim != 1:
                raise DataUnavailableError(
                    f"MedMNIST file '{file}': {split}_labels has shape {labels.shape}, expected "
                    "[N, 1] (one class per image; multi-label subsets are not supported)"
                )
            parts.append(labels.astype(np.int64))
    return np.concatenate(parts)


def _cache_path(file: Path, cache_dir: Path) -> Path:
    """The pooled-images cache of ``file``, keyed by its path, size and modification time."""
    status = file.stat()
    key = [CACHE_VERSION, str(file.resolve()), status.st_size, status.st_mtime_ns]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", file.stem)
    return cache_dir / "datasets" / "medmnist" / f"{stem}-{digest}.npy"


@functools.lru_cache(maxsize=2)
def _pooled_images(file: Path, cache: Path) -> np.ndarray:
    """The pooled uint8 images of ``file``, memory-mapped from ``cache`` (written if needed)."""
    if cache.is_file():
        try:
            return np.load(cache, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            log.warning("MedMNIST cache %s is unreadable (%s); rewriting it", cache, err)
    with _open(file) as stored:
        shapes = []
        for split in SPLITS:
            images, labels = stored[f"{split}_images"], stored[f"{split}_labels"]
            if images.ndim not in (3, 4) or len(images) != len(labels):
                raise DataUnavailableError(
                    f"MedMNIST file '{file}': {split}_images has shape {images.shape} for "
                    f"{len(labels)} labels; expected [N, s, s] or [N, s, s, 3]"
                )
            shapes.append(images.shape)
        if len({shape[1:] for shape in shapes}) != 1:
            raise DataUnavailableError(f"MedMNIST file '{file}': splits differ in shape {shapes}")
        total = sum(shape[0] for shape in shapes)
        with atomic_path(cache, durable=False) as temporary:
            pooled = np.lib.format.open_memmap(
                temporary, mode="w+", dtype=np.uint8, shape=(total, *shapes[0][1:])
            )
            start = 0
            for split in SPLITS:  # one split in memory at a time
                images = stored[f"{split}_images"]
                pooled[start : start + len(images)] = images
                start += len(images)
            pooled.flush()
            del pooled
    return np.load(cache, mmap_mode="r", allow_pickle=False)
