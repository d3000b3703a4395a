"""A labelled image source: labels and natural ids up front, pixels decoded on demand.

Partitioning only needs labels (and, for ``natural-id``, one id per sample), so a source
exposes those as arrays and keeps the pixels where they are: an in-memory tensor for the
embedded digits, the Arrow-backed ``datasets.Dataset`` for the papers' datasets, decoded and
resized only for the rows a client actually holds. Samples are named by their position in the
source (the *sample id*); every split and partition in this package is an array of sample ids,
which is also how tests check that splits are disjoint and cover the data.

This module is the type only: the embedded digits (``digits``) and the loaders of the other
datasets (``loaders``) make sources, and ``loaders.load_source`` picks one by the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # partitioning reads labels only; the launcher's checks need no torch
    import torch


class DataUnavailableError(RuntimeError):
    """The dataset could not be loaded; the message says how to provide it (``data-dir``)."""


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
    public_ids: np.ndarray | None = None  # a public split fixed by the dataset (glyph-domains)

    def __len__(self) -> int:
        """Number of samples."""
        return len(self.labels)

    def images(self, sample_ids: np.ndarray) -> torch.Tensor:
        """RGB images of ``sample_ids`` as ``[n, 3, H, W]`` floats in ``[0, 1]``."""
        return self.pixels(np.asarray(sample_ids, dtype=np.int64))
