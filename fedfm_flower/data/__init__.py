"""Federated image data: datasets, the public split, partitions and per-client splits.

``load_client_data(config, partition_id, num_partitions)`` gives one client its train/test
(and validation) tensors; ``load_public_split(config)`` gives the public split no client holds,
on which the offline foundation model is pretrained; ``num_classes_of(config)`` sizes heads.

Modules, one concept each: ``registry`` (dataset name -> spec), ``source`` (the ``Source``
type: labels up front, pixels on demand), ``digits`` (the embedded offline data), ``loaders``
(``load_source``: the digits, local copies or the Hugging Face Hub), ``splits`` (seeded
stratified splits), ``partition`` (flwr-datasets partitioners), ``domains`` (synthetic feature
skew), ``images`` (resizing and normalization), ``federated`` (this API), ``sizes`` (example
counts; the smallest partition a run accepts).
Heavy libraries (``datasets``, ``flwr_datasets``, scikit-learn) are imported only when data is
first prepared; the names below resolve on first use, so importing this package (or its light
``registry``, which the config reads) imports neither torch nor those libraries.
"""

from __future__ import annotations

from fedfm_flower import lazy_getattr

_EXPORTS = {
    "DOMAINS": "fedfm_flower.data.domains",
    "Domain": "fedfm_flower.data.domains",
    "ClientData": "fedfm_flower.data.federated",
    "ClientSampleIds": "fedfm_flower.data.federated",
    "clear_caches": "fedfm_flower.data.federated",
    "client_domains": "fedfm_flower.data.federated",
    "client_sample_ids": "fedfm_flower.data.federated",
    "load_client_data": "fedfm_flower.data.federated",
    "load_public_split": "fedfm_flower.data.federated",
    "num_classes_of": "fedfm_flower.data.federated",
    "public_sample_ids": "fedfm_flower.data.federated",
    "DataUnavailableError": "fedfm_flower.data.source",
    "DATASETS": "fedfm_flower.data.registry",
    "DatasetSpec": "fedfm_flower.data.registry",
    "dataset_spec": "fedfm_flower.data.registry",
    "ClientExamples": "fedfm_flower.data.sizes",
    "PartitionTooSmallError": "fedfm_flower.data.sizes",
    "check_client_sizes": "fedfm_flower.data.sizes",
    "client_example_counts": "fedfm_flower.data.sizes",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
