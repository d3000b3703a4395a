"""The embedded offline dataset: scikit-learn's ``load_digits`` (1,797 real 8x8 digits).

It ships inside scikit-learn, so every machine (CI included) has real image data without a
download. The 17-level gray images are scaled to ``[0, 1]`` and kept at 8x8; the samples a
client asks for are bilinearly upscaled to the configured image size and repeated to three
channels when asked. Upscaling the whole set up front would hold 1,797 images at full size in
every process (1.08 GiB at 224 px) next to the clients' own copies, and cost seconds per
message in deployment; each image is resized on its own, so the pixels are the same either way.

``digits`` and ``digits-domains`` share these pixels and labels, hence the same public split
and the same foundation model; ``digits-domains`` only adds synthetic domains (see
``fedfm_flower.data.domains``), assigned per sample when partitioning.

Imports inside functions keep ``sklearn`` and ``torch`` out of this module's start-up.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedfm_flower.data.domains import DOMAINS
from fedfm_flower.data.images import upscale_gray
from fedfm_flower.data.source import Source

if TYPE_CHECKING:
    import torch

NUM_CLASSES = 10


@functools.lru_cache(maxsize=1)
def digits_arrays() -> tuple[torch.Tensor, np.ndarray]:
    """The raw digits: gray images ``[1797, 8, 8]`` in ``[0, 1]`` and int64 labels."""
    import torch

    table = _digits_table()
    images = torch.from_numpy(table[:, :-1].reshape(-1, 8, 8).astype(np.float32) / 16.0)
    return images, digits_labels()


@functools.lru_cache(maxsize=1)
def digits_labels() -> np.ndarray:
    """The digits' int64 labels (no torch: partitioning reads labels only)."""
    return _digits_table()[:, -1].astype(np.int64)


@functools.lru_cache(maxsize=1)
def _digits_table() -> np.ndarray:
    """``load_digits``'s table (64 pixels and the label per row), read without its import.

    Importing ``sklearn.datasets`` costs about 2 s here, paid on every message in deployment
    (each message starts a fresh ClientApp process), so the CSV that scikit-learn ships is read
    directly; ``load_digits`` itself is the fallback should the file ever move.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as file:
                return np.loadtxt(file, delimiter=",")
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target])


def digits_pixels(image_size: int, sample_ids: np.ndarray | None = None) -> torch.Tensor:
    """The digits ``sample_ids`` (all when None) as RGB ``[n, 3, image_size, image_size]``."""
    images, _ = digits_arrays()
    if sample_ids is not None:
        import torch

        images = images[torch.from_numpy(np.asarray(sample_ids, dtype=np.int64))]
    return upscale_gray(images, image_size)


def digits_source(name: str, image_size: int, with_domains: bool) -> Source:
    """The digits as a ``Source``; ``with_domains`` adds the synthetic ``domain`` column."""
    labels = digits_labels()
    return Source(
        name=name,
        labels=labels,
        num_classes=NUM_CLASSES,
        natural_id_column="domain" if with_domains else "",
        natural_ids=None,
        synthetic_domains=len(DOMAINS) if with_domains else 0,
        pixels=lambda ids: digits_pixels(image_size, ids),
    )
