"""Federated image data: datasets, the public split, partitions and per-client splits.

``load_client_data(config, partition_id, num_partitions)`` gives one client its train/test
(and validation) tensors; ``load_public_split(config)`` gives the public split no client holds,
on which the offline foundation model is pretrained; ``num_classes_of(config)`` sizes heads.

Modules, one concept each: ``registry`` (dataset name -> spec), ``digits`` (the embedded
offline data), ``loaders`` (local copies and the Hugging Face Hub), ``source`` (labels up
front, pixels on demand), ``splits`` (seeded stratified splits), ``partition`` (flwr-datasets
partitioners), ``domains`` (synthetic feature skew), ``images`` (resizing and normalization),
``federated`` (this API), ``sizes`` (example counts; the smallest partition a run accepts).
Heavy libraries (``datasets``, ``flwr_datasets``, scikit-learn) are imported only when data is
first prepared, so importing this package stays cheap.
"""

from fedfm_flower.data.domains import DOMAINS, Domain
from fedfm_flower.data.federated import (
    ClientData,
    ClientSampleIds,
    clear_caches,
    client_sample_ids,
    load_client_data,
    load_public_split,
    num_classes_of,
    public_sample_ids,
)
from fedfm_flower.data.loaders import DataUnavailableError
from fedfm_flower.data.registry import DATASETS, DatasetSpec, dataset_spec
from fedfm_flower.data.sizes import (
    ClientExamples,
    PartitionTooSmallError,
    check_client_sizes,
    client_example_counts,
)

__all__ = [
    "DATASETS",
    "DOMAINS",
    "ClientData",
    "ClientExamples",
    "ClientSampleIds",
    "DataUnavailableError",
    "DatasetSpec",
    "Domain",
    "PartitionTooSmallError",
    "check_client_sizes",
    "clear_caches",
    "client_example_counts",
    "client_sample_ids",
    "dataset_spec",
    "load_client_data",
    "load_public_split",
    "num_classes_of",
    "public_sample_ids",
]
