"""Loading a registered dataset as a ``Source``: the embedded digits, or for the papers'
datasets a local copy under ``data-dir``, else the Hugging Face Hub.

``load_source`` picks the loader by the registry's spec and caches one source per (dataset,
data-dir, image size, natural-id column) in the process, so a ClientApp that loads its data on
every message pays the preparation once. The embedded digits are ``fedfm_flower.data.digits``,
MedMNIST's ``.npz`` files (OrganAMNIST) ``fedfm_flower.data.medmnist``; the rest of this module
loads the other datasets.

Local copies come in two layouts, told apart by their files:

* a ``datasets`` save (``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``: the folder
  holds ``state.json`` or ``dataset_dict.json``), read with ``datasets.load_from_disk``;
* an image folder, read with ``datasets.load_dataset("imagefolder", data_dir=...)``. The class
  is the name of the folder holding the image. For datasets with natural client ids
  (DomainNet, Office-Caltech10, Office-Home, Omniglot) the id is the folder above the class
  folder: ``<data-dir>/<domain>/<class>/<image>`` (Omniglot:
  ``<data-dir>/<drawer>/<alphabet>/<image>``), unless a ``metadata.csv`` beside the images
  supplies the natural-id column itself. Top-level ``train``/``test`` folders are taken as
  splits by ``datasets``; they are merged.

Without ``data-dir`` the registry's Hub name is loaded (this needs internet, and is cached by
``datasets`` as usual); a failure becomes ``DataUnavailableError`` saying to set ``data-dir``.
All splits of a ``DatasetDict`` are concatenated (train first): this package makes its own
public, train and test splits. Rows with a negative label (unlabelled test splits) are dropped,
string labels become class indices in sorted order, and ``top_classes`` keeps the most
frequent classes, renumbered in their original order. Image folders are converted into Arrow
files under ``<cache-dir>/datasets``; images are decoded and resized only for the rows asked.

Imports inside functions keep ``datasets`` and ``torch`` out of this module's start-up.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedfm_flower.data.digits import digits_source
from fedfm_flower.data.glyphs import glyph_source
from fedfm_flower.data.images import pil_to_tensor
from fedfm_flower.data.registry import DatasetSpec, dataset_spec
from fedfm_flower.data.settings import DataSettings
from fedfm_flower.data.source import DataUnavailableError, Source

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label",)


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
        if natural_id_column and natural_id_column != spec.natural_id_column:
            raise ValueError(
                f"dataset '{name}' has no column '{natural_id_column}'; its natural-id column "
                f"is {spec.natural_id_column or 'absent'!r}"
            )
        if name == "glyph-domains":
            return glyph_source(Path(cache_dir), image_size)

        return digits_source(name, image_size, with_domains=bool(spec.natural_id_column))
    if spec.medmnist_flag:
        from fedfm_flower.data.medmnist import medmnist_source

        if natural_id_column:
            raise ValueError(
                f"dataset '{name}' has no column '{natural_id_column}': it has no natural ids"
            )
        return medmnist_source(name, spec.medmnist_flag, data_dir, cache_dir, image_size)
    return loaded_source(
        name, spec, data_dir, cache_dir, image_size, natural_id_column or spec.natural_id_column
    )


def load_raw(name: str, spec: DatasetSpec, data_dir: str, cache_dir: str) -> tuple[Any, bool]:
    """The dataset as one ``datasets.Dataset`` and whether it came from an image folder."""
    import datasets

    if data_dir:
        path = Path(data_dir).expanduser()
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return merge_splits(datasets.load_from_disk(str(path))), False
        try:
            loaded = datasets.load_dataset(
                "imagefolder", data_dir=str(path), cache_dir=str(Path(cache_dir) / "datasets")
            )
        except Exception as err:
            raise DataUnavailableError(
                f"data-dir '{path}' is neither a saved dataset (save_to_disk) nor an image "
                f"folder datasets can read ({type(err).__name__}: {err})"
            ) from err
        return merge_splits(loaded), True
    if not spec.hub_name:
        raise DataUnavailableError(
            f"dataset '{name}' has no known Hugging Face Hub copy: set run config 'data-dir' to "
            "a local copy (a save_to_disk folder or an image folder "
            "<data-dir>/<natural id>/<class>/<image>)"
        )
    try:
        loaded = datasets.load_dataset(spec.hub_name)
    except Exception as err:
        raise DataUnavailableError(
            f"could not load dataset '{name}' from the Hugging Face Hub as '{spec.hub_name}' "
            f"({type(err).__name__}: {err}). Without internet, set run config 'data-dir' to a "
            "local copy (a folder written by save_to_disk, or an image folder)"
        ) from err
    return merge_splits(loaded), False


def merge_splits(loaded: Any) -> Any:
    """One ``Dataset`` from a ``Dataset`` or ``DatasetDict`` (all splits, train first)."""
    import datasets

    if isinstance(loaded, datasets.Dataset):
        return loaded
    names = sorted(loaded, key=lambda split: (split != "train", split))
    if len(names) == 1:
        return loaded[names[0]]
    try:
        return datasets.concatenate_datasets([loaded[split] for split in names])
    except ValueError as err:
        first = names[0]
        log.warning("splits %s differ (%s); using split '%s' only", names, err, first)
        return loaded[first]


def loaded_source(
    name: str,
    spec: DatasetSpec,
    data_dir: str,
    cache_dir: str,
    image_size: int,
    natural_id_column: str,
) -> Source:
    """A ``Source`` over a local copy or the Hub copy of a registered dataset."""
    raw, from_folder = load_raw(name, spec, data_dir, cache_dir)
    columns = list(raw.column_names)
    image_column = _pick_column(name, columns, (spec.image_column, *IMAGE_COLUMNS), "image")
    label_column = _pick_column(name, columns, (spec.label_column, *LABEL_COLUMNS), "label")

    labels, class_names = _class_indices(raw, label_column)
    keep = labels >= 0
    num_classes = len(class_names) if class_names else int(labels[keep].max(initial=-1)) + 1
    if spec.top_classes:
        labels, keep, num_classes = _top_classes(labels, keep, spec.top_classes)
    rows = np.flatnonzero(keep)
    if rows.size == 0:
        raise ValueError(f"dataset '{name}' has no labelled rows in column '{label_column}'")
    if not data_dir and num_classes != spec.num_classes:
        raise ValueError(
            f"dataset '{name}' from the Hub has {num_classes} classes, the registry expects "
            f"{spec.num_classes}; use a local copy via 'data-dir'"
        )

    natural_ids = None
    if natural_id_column:
        if natural_id_column in columns:
            natural_ids = column_values(raw, natural_id_column)[rows]
        elif from_folder:
            natural_ids = _folder_ids(raw, image_column)[rows]

    def pixels(sample_ids: np.ndarray) -> torch.Tensor:
        return pil_to_tensor(raw.select(rows[sample_ids])[image_column], image_size)

    return Source(
        name=name,
        labels=labels[rows].astype(np.int64),
        num_classes=num_classes,
        natural_id_column=natural_id_column,
        natural_ids=natural_ids,
        synthetic_domains=0,
        pixels=pixels,
    )


def column_values(raw: Any, column: str) -> np.ndarray:
    """One column of a ``datasets.Dataset`` as a numpy array, read in bulk from Arrow."""
    return np.asarray(raw.select_columns([column]).with_format("numpy")[:][column])


def _pick_column(name: str, columns: list[str], candidates: tuple[str, ...], kind: str) -> str:
    candidates = tuple(dict.fromkeys(candidates))
    for column in candidates:
        if column in columns:
            return column
    raise ValueError(
        f"dataset '{name}' has no {kind} column (looked for {', '.join(candidates)}); "
        f"its columns are {', '.join(columns)}"
    )


def _class_indices(raw: Any, label_column: str) -> tuple[np.ndarray, list[str]]:
    """Integer labels and class names (empty when the labels are plain integers)."""
    import datasets

    feature = raw.features[label_column]
    values = column_values(raw, label_column)
    if isinstance(feature, datasets.ClassLabel):
        return values.astype(np.int64), list(feature.names)
    if values.dtype.kind in "OUS":
        names = sorted({str(v) for v in values})
        return np.searchsorted(names, values.astype(str)).astype(np.int64), names
    return values.astype(np.int64), []


def _top_classes(
    labels: np.ndarray, keep: np.ndarray, top: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Keep the ``top`` most frequent classes (ties: lower index), renumbered in order."""
    counts = np.bincount(labels[keep])
    chosen = np.sort(np.argsort(-counts, kind="stable")[:top])
    lookup = np.full(max(int(labels.max()) + 1, len(counts)), -1, dtype=np.int64)
    lookup[chosen] = np.arange(len(chosen))
    remapped = np.where(keep, lookup[np.where(keep, labels, 0)], -1)
    return remapped, remapped >= 0, len(chosen)


def _folder_ids(raw: Any, image_column: str) -> np.ndarray:
    """Natural ids of an image folder: the folder above each image's class folder."""
    import datasets

    files = raw.select_columns([image_column]).cast_column(
        image_column, datasets.Image(decode=False)
    )
    table = files.with_format("arrow")[:]
    ids = []
    for path in table.column(image_column).combine_chunks().field("path").to_pylist():
        parts = Path(path).parts
        if len(parts) < 3:
            raise ValueError(f"image '{path}' is not in <natural id>/<class>/<image> layout")
        ids.append(parts[-3])
    return np.asarray(ids)
