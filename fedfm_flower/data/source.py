"""A labelled image source: labels and natural ids up front, pixels decoded on demand.

Partitioning only needs labels (and, for ``natural-id``, one id per sample), so a source
exposes those as arrays and keeps the pixels where they are: an in-memory tensor for the
embedded digits, the Arrow-backed ``datasets.Dataset`` for the papers' datasets, decoded and
resized only for the rows a client actually holds. Samples are named by their position in the
source (the *sample id*); every split and partition in this package is an array of sample ids,
which is also how tests check that splits are disjoint and cover the data.

``load_source`` caches one source per (dataset, data-dir, image size, natural-id column) in the
process, so a ClientApp that loads its data on every message pays the preparation once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedfm_flower.data.registry import dataset_spec
from fedfm_flower.data.settings import DataSettings


@dataclass(frozen=True, eq=False)
class Source:
    """Labels, optional natural ids and on-demand pixels of one labelled image dataset."""

    name: str
    labels: np.ndarray  # int64 [N], in [0, num_classes)
    num_classes: int
    natural_id_column: str  # "" when the dataset has none
    natural_ids: np.ndarray | None  # [N] values of that column; None when absent or synthetic
    synthetic_domains: int  # > 0: ids are synthetic, assigned when partitioning (digits-domains)
    pixels: Callable[[np.ndarray], torch.Tensor]  # sample ids -> [n, 3, H, W] in [0, 1]

    def __len__(self) -> int:
        """Number of samples."""
        return len(self.labels)

    def images(self, sample_ids: np.ndarray) -> torch.Tensor:
        """RGB images of ``sample_ids`` as ``[n, 3, H, W]`` floats in ``[0, 1]``."""
        return self.pixels(np.asarray(sample_ids, dtype=np.int64))


def load_source(settings: DataSettings) -> Source:
    """The (process-cached) source of ``settings.dataset``."""
    return _cached_source(
        settings.dataset,
        settings.data_dir,
        settings.cache_dir,
        settings.image_size,
        settings.natural_id_column,
    )


@functools.lru_cache(maxsize=4)
def _cached_source(
    name: str, data_dir: str, cache_dir: str, image_size: int, natural_id_column: str
) -> Source:
    spec = dataset_spec(name)
    if spec.embedded:
        from fedfm_flower.data.digits import digits_source

        if natural_id_column and natural_id_column != spec.natural_id_column:
            raise ValueError(
                f"dataset '{name}' has no column '{natural_id_column}'; its natural-id column "
                f"is {spec.natural_id_column or 'absent'!r}"
            )
        return digits_source(name, image_size, with_domains=bool(spec.natural_id_column))
    from fedfm_flower.data.loaders import loaded_source

    return loaded_source(
        name, spec, data_dir, cache_dir, image_size, natural_id_column or spec.natural_id_column
    )
