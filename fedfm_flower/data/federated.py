"""The data each party sees: a client's train/test(/val) split and the public pretraining split.

``load_client_data`` is what a ClientApp calls (possibly on every message): everything it
builds on (the source pixels, the public split, the partition plan) is cached in the process,
and so is its result, per data settings and client. The returned tensors are shared between
calls: treat them as read-only.

Client ``p`` of ``digits-domains`` sees its partition through domain ``DOMAINS[p % 10]`` (with
``natural-id``, client ``p`` holds exactly domain ``p``'s samples, so it is the same rule).
The public split is always the clean, untransformed data.

Imports inside functions keep ``torch`` out of this module's start-up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data import digits, loaders, partition
from fedfm_flower.data.domains import DOMAINS
from fedfm_flower.data.images import normalize
from fedfm_flower.data.loaders import load_source
from fedfm_flower.data.partition import partition_plan, public_and_private
from fedfm_flower.data.registry import dataset_spec
from fedfm_flower.data.settings import DataSettings
from fedfm_flower.data.splits import client_split, pretrain_split

if TYPE_CHECKING:  # torch loads with the first tensors: partition checks need none
    from torch.utils.data import TensorDataset

    from fedfm_flower.data.domains import Domain
    from fedfm_flower.data.source import Source


@dataclass(frozen=True)
class ClientData:
    """One client's data: images ``[N, 3, H, W]`` in ``[-1, 1]`` and int64 labels ``[N]``."""

    train: TensorDataset
    test: TensorDataset
    val: TensorDataset | None  # None when val-fraction is 0
    num_classes: int


@dataclass(frozen=True)
class ClientSampleIds:
    """Sample ids (positions in the source dataset) of one client's splits."""

    train: np.ndarray
    test: np.ndarray
    val: np.ndarray


def num_classes_of(config: ExperimentConfig) -> int:
    """Number of classes of the configured dataset (loads a local copy to count them)."""
    spec = dataset_spec(config.dataset)
    if spec.embedded or not config.data_dir:
        return spec.num_classes

    return load_source(DataSettings.from_config(config)).num_classes


def load_client_data(
    config: ExperimentConfig, partition_id: int, num_partitions: int
) -> ClientData:
    """Client ``partition_id``'s train/test (and validation) split, cached in the process."""
    _check_partition(partition_id, num_partitions)
    return _client_data(DataSettings.from_config(config), partition_id, num_partitions)


def load_public_split(config: ExperimentConfig) -> tuple[TensorDataset, TensorDataset, int]:
    """(pretrain train, pretrain test, num classes) from the public split no client holds."""
    return _public_data(DataSettings.from_config(config))


def client_sample_ids(
    config: ExperimentConfig, partition_id: int, num_partitions: int
) -> ClientSampleIds:
    """Which source samples client ``partition_id`` holds in each of its splits."""
    _check_partition(partition_id, num_partitions)
    return _client_ids(DataSettings.from_config(config), partition_id, num_partitions)


def client_domains(config: ExperimentConfig, num_partitions: int) -> dict[str, str]:
    """{partition: the name of the one domain it holds} (the columns of pFedPG's Table 1):
    the natural id of a ``natural-id`` or ``domain-dirichlet`` partition (an image folder's
    domain folder, a copy's domain value), the synthetic domain of ``digits-domains``; empty
    where partitions mix domains (any other partitioner of a dataset with natural ids) or the
    dataset has none."""
    settings = DataSettings.from_config(config)
    source = load_source(settings)
    natural = partition_plan(settings, num_partitions).natural_ids
    if source.synthetic_domains:  # as _client_data sees them
        return {
            str(p): DOMAINS[(int(natural[p]) if natural is not None else p) % len(DOMAINS)].name
            for p in range(num_partitions)
        }
    if natural is None:
        return {}
    return {str(p): str(natural[p]) for p in range(num_partitions)}


def public_sample_ids(config: ExperimentConfig) -> tuple[np.ndarray, np.ndarray]:
    """(pretrain train, pretrain test) sample ids of the public split."""
    return _public_ids(DataSettings.from_config(config))


def _check_partition(partition_id: int, num_partitions: int) -> None:
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id must lie in [0, {num_partitions}), got {partition_id}")


@functools.lru_cache(maxsize=256)
def _client_ids(settings: DataSettings, partition_id: int, num_partitions: int) -> ClientSampleIds:

    ids = partition_plan(settings, num_partitions).partitions[partition_id]
    labels = load_source(settings).labels[ids]
    train, test, val = client_split(
        labels, settings.test_fraction, settings.val_fraction, settings.seed, partition_id
    )
    return ClientSampleIds(ids[train], ids[test], ids[val])


@functools.lru_cache(maxsize=64)
def _client_data(settings: DataSettings, partition_id: int, num_partitions: int) -> ClientData:

    ids = _client_ids(settings, partition_id, num_partitions)
    source = load_source(settings)
    domain = None
    if source.synthetic_domains:
        natural = partition_plan(settings, num_partitions).natural_ids
        index = int(natural[partition_id]) if natural is not None else partition_id
        domain = DOMAINS[index % len(DOMAINS)]

    return ClientData(
        train=_tensor_dataset(source, ids.train, domain),
        test=_tensor_dataset(source, ids.test, domain),
        val=_tensor_dataset(source, ids.val, domain) if settings.val_fraction > 0 else None,
        num_classes=source.num_classes,
    )


@functools.lru_cache(maxsize=8)
def _public_ids(settings: DataSettings) -> tuple[np.ndarray, np.ndarray]:

    public, _ = public_and_private(settings)
    train, test = pretrain_split(load_source(settings).labels[public], settings.seed)
    return public[train], public[test]


@functools.lru_cache(maxsize=4)
def _public_data(settings: DataSettings) -> tuple[TensorDataset, TensorDataset, int]:

    source = load_source(settings)
    train, test = _public_ids(settings)
    return _tensor_dataset(source, train), _tensor_dataset(source, test), source.num_classes


def _tensor_dataset(
    source: Source, sample_ids: np.ndarray, domain: Domain | None = None
) -> TensorDataset:
    """Normalized images (seen through ``domain`` when given) and int64 labels of the samples."""
    import torch
    from torch.utils.data import TensorDataset

    images = source.images(sample_ids)
    if domain is not None:
        images = domain(images)
    labels = torch.from_numpy(source.labels[sample_ids].astype(np.int64))
    return TensorDataset(normalize(images), labels)


def clear_caches() -> None:
    """Forget every prepared source, split and client dataset held in this process."""

    for cached in (
        _client_ids,
        _client_data,
        _public_ids,
        _public_data,
        partition.partition_plan,
        partition.public_and_private,
        loaders._cached_source,
        digits.digits_arrays,
        digits.digits_labels,
    ):
        cached.cache_clear()
