"""Who holds what: the public hold-out, then flwr-datasets partitioners over the rest.

The order of operations is fixed and seeded by ``seed``:

1. a stratified ``public-fraction`` of the whole dataset is held out (``splits.public_split``),
   or the dataset's own fixed public split where it has one (``glyph-domains``); no client
   ever holds one of those samples;
2. the remaining (private) samples are shuffled, so that ``IidPartitioner``'s contiguous shards
   are random, and put into a small ``datasets.Dataset`` of ``sample_id``, ``label`` and, for
   ``natural-id``, the natural-id column; pixels stay out of it;
3. a flwr-datasets partitioner assigns them to clients (``p.dataset = table``,
   ``p.load_partition(i)``), or one of this module's (``disjoint``, ``domain-dirichlet``):

   * ``iid``: ``IidPartitioner``;
   * ``dirichlet``: ``DirichletPartitioner`` by label, ``alpha = dirichlet-alpha``, no
     self-balancing, ``min_partition_size = 2`` (one training and one test sample): larger
     minimums make flwr-datasets give up on many clients with small alpha (measured on the
     digits: 10 fails from 20 clients at alpha 0.1; 2 works up to 50 clients at alpha 0.1
     and 100 at alpha 0.3);
   * ``pathological``: ``PathologicalPartitioner`` with ``classes-per-client`` classes each,
     ``class_assignment_mode="first-deterministic"`` (client ``p`` surely has class
     ``p mod C``, the others are drawn with the seed), the setting of the original paper;
   * ``disjoint`` (not flwr-datasets'): client ``p`` holds every private sample of
     ``classes-per-client`` classes that no other client holds, the classes drawn with the
     seed (a permutation of the classes present, client ``p`` taking block ``p``); it needs
     ``num-clients x classes-per-client`` <= the number of classes, and classes left over
     go to no client (pFedPG's "disjoint label space", after ViT-FL);
   * ``natural-id``: ``NaturalIdPartitioner`` on the natural-id column; there is one client
     per distinct value (in sorted order), so ``num_partitions`` must equal that count;
   * ``domain-dirichlet``: clients are dealt round-robin to the sorted natural ids (domains),
     client ``p`` to domain ``p mod D``, and each domain's samples are split over its clients
     by ``DirichletPartitioner`` on the label (one seeded stream per domain): feature skew
     across domains, label skew within them (the many-client setups).

For ``digits-domains`` the ``domain`` column is synthetic: the shuffled private samples are
dealt round-robin to ``len(DOMAINS)`` domains (sample ``k`` of the shuffled order gets domain
``k mod len(DOMAINS)``), so natural-id clients get equal-sized, label-balanced domains.

A computed plan is also written to ``<cache-dir>/partitions/<key>.npz`` (atomically; no pickle),
keyed by every input of the plan: the partition settings, the number of clients, the dataset's
labels and natural ids, and the flwr-datasets version. In deployment every message starts a
fresh ClientApp process; with the plan on disk it needs neither ``datasets`` nor
``flwr_datasets`` (about 1.5 s of imports per message). A file that cannot be read is
recomputed and replaced.

Imports inside functions keep ``datasets`` and ``flwr_datasets`` out of this module's start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from fedfm_flower.data.loaders import load_source
from fedfm_flower.data.settings import DataSettings
from fedfm_flower.data.source import Source
from fedfm_flower.data.splits import (
    CLASS_DRAW_STREAM,
    DOMAIN_STREAM,
    PRIVATE_ORDER_STREAM,
    complement,
    entropy,
    public_split,
    rng_for,
)
from fedfm_flower.records.durable import atomic_path

LABEL = "label"
SAMPLE_ID = "sample_id"
MIN_PARTITION_SIZE = 2  # one training and one test sample
PLAN_CACHE_VERSION = 2  # bump whenever the plan's computation changes (stale files then miss)

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class PartitionPlan:
    """Sample ids of the public split and of every client's partition."""

    public: np.ndarray
    partitions: tuple[np.ndarray, ...]
    natural_ids: tuple[Any, ...] | None  # each client's natural id (natural-id only)


@functools.lru_cache(maxsize=8)
def public_and_private(settings: DataSettings) -> tuple[np.ndarray, np.ndarray]:
    """(public, private) sample ids; private ones in their seeded shuffled order."""
    source = load_source(settings)
    if source.public_ids is not None:  # fixed by the dataset; public-fraction does not apply
        public = np.sort(source.public_ids)
        private = complement(len(source), public)
    else:
        public, private = public_split(source.labels, settings.public_fraction, settings.seed)
    return public, rng_for(settings.seed, PRIVATE_ORDER_STREAM).permutation(private)


@functools.lru_cache(maxsize=8)
def partition_plan(settings: DataSettings, num_partitions: int) -> PartitionPlan:
    """The partition of the private samples over ``num_partitions`` clients (cached in the
    process and on disk)."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    path = plan_cache_path(settings, num_partitions)
    plan = _read_plan(path)
    if plan is None:
        plan = _compute_plan(settings, num_partitions)
        _write_plan(path, plan)
    return plan


def plan_cache_path(settings: DataSettings, num_partitions: int) -> Path:
    """The file that holds the plan for these settings, keyed by every input of the plan."""
    source = load_source(settings)
    digest = hashlib.sha256()
    fields = {
        "version": PLAN_CACHE_VERSION,
        "flwr-datasets": metadata.version("flwr-datasets"),
        "dataset": settings.dataset,
        "data-dir": settings.data_dir,
        "partitioner": settings.partitioner,
        "dirichlet-alpha": settings.dirichlet_alpha,
        "classes-per-client": settings.classes_per_client,
        "natural-id-column": settings.natural_id_column,
        "public-fraction": settings.public_fraction,
        "seed": settings.seed,
        "num-partitions": num_partitions,
        "min-partition-size": MIN_PARTITION_SIZE,
        "synthetic-domains": source.synthetic_domains,
    }
    digest.update(json.dumps(fields, sort_keys=True).encode())
    digest.update(np.ascontiguousarray(source.labels, dtype=np.int64).tobytes())
    if source.natural_ids is not None:
        digest.update(json.dumps([str(v) for v in source.natural_ids]).encode())
    if source.public_ids is not None:
        digest.update(np.ascontiguousarray(source.public_ids, dtype=np.int64).tobytes())
    return Path(settings.cache_dir) / "partitions" / f"{digest.hexdigest()[:24]}.npz"


def _read_plan(path: Path) -> PartitionPlan | None:
    """The plan stored at ``path``; None when there is none or it cannot be read."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            sizes = stored["sizes"]
            flat = stored["partitions"]
            natural = json.loads(str(stored["natural_ids"]))
            plan = PartitionPlan(
                public=stored["public"].copy(),
                partitions=tuple(np.split(flat, np.cumsum(sizes)[:-1])),
                natural_ids=None if natural is None else tuple(natural),
            )
        if int(sizes.sum()) != len(flat):
            raise ValueError(f"sizes add up to {int(sizes.sum())}, not {len(flat)}")
        return plan
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
        log.warning("partition cache %s is unreadable (%s); recomputing it", path, err)
        return None


def _write_plan(path: Path, plan: PartitionPlan) -> None:
    """Store ``plan`` at ``path`` atomically (a cache: no fsync, an unreadable file is
    recomputed); a cache that cannot be written is only logged."""
    natural = None if plan.natural_ids is None else list(plan.natural_ids)
    try:
        with atomic_path(path, durable=False) as temporary, temporary.open("wb") as file:
            np.savez(
                file,
                public=plan.public,
                partitions=np.concatenate([*plan.partitions, np.zeros(0, np.int64)]),
                sizes=np.array([len(p) for p in plan.partitions], dtype=np.int64),
                natural_ids=np.array(json.dumps(natural)),
            )
    except (OSError, TypeError, ValueError) as err:
        log.warning("could not write the partition cache %s: %s", path, err)


def _plain(value: Any) -> Any:
    """A natural id as a JSON value (numpy scalars become Python ones)."""
    return value.item() if isinstance(value, np.generic) else value


def _compute_plan(settings: DataSettings, num_partitions: int) -> PartitionPlan:
    """Partition the private samples with flwr-datasets."""
    from datasets import Dataset

    source = load_source(settings)
    public, private = public_and_private(settings)
    if settings.partitioner == "domain-dirichlet":
        partitions, domains = _domain_dirichlet(settings, source, private, num_partitions)
        return PartitionPlan(public, partitions, domains)
    if settings.partitioner == "disjoint":
        return PartitionPlan(public, _disjoint(settings, source, private, num_partitions), None)
    columns: dict[str, Any] = {SAMPLE_ID: private, LABEL: source.labels[private]}
    natural_column = ""
    if settings.partitioner == "natural-id":
        natural_column = source.natural_id_column or settings.natural_id_column
        columns[natural_column] = _natural_ids(settings, source, private)
    partitioner = make_partitioner(settings, num_partitions, natural_column)
    partitioner.dataset = Dataset.from_dict(columns)
    if natural_column and partitioner.num_partitions != num_partitions:
        found = partitioner.num_partitions
        raise ValueError(
            f"partitioner 'natural-id' makes one client per distinct value of column "
            f"'{natural_column}' of dataset '{settings.dataset}' ({found} values), but "
            f"num_partitions is {num_partitions}: set num-clients / the number of "
            f"SuperNodes to {found}"
        )
    try:
        partitions = tuple(
            np.asarray(partitioner.load_partition(p)[SAMPLE_ID], dtype=np.int64)
            for p in range(num_partitions)
        )
    except ValueError as err:
        raise ValueError(
            f"partitioner '{settings.partitioner}' could not split {len(private)} samples of "
            f"dataset '{settings.dataset}' over {num_partitions} clients ({err}); use fewer "
            "clients, a larger dirichlet-alpha or a smaller public-fraction"
        ) from err
    natural_ids = None
    if natural_column:
        natural_ids = tuple(  # plain Python values, as they read back from the cache
            _plain(partitioner.partition_id_to_natural_id[p]) for p in range(num_partitions)
        )
    return PartitionPlan(public, partitions, natural_ids)


def _domain_dirichlet(
    settings: DataSettings, source: Source, private: np.ndarray, num_partitions: int
) -> tuple[tuple[np.ndarray, ...], tuple[Any, ...]]:
    """Clients dealt round-robin to the sorted domains; Dirichlet label skew within each."""
    from datasets import Dataset

    natural = np.asarray(_natural_ids(settings, source, private))
    domains = sorted(set(natural.tolist()))
    if num_partitions < len(domains):
        raise ValueError(
            f"partitioner 'domain-dirichlet' needs at least one client per domain: dataset "
            f"'{settings.dataset}' has {len(domains)} domains, num_partitions is {num_partitions}"
        )
    partitions: list[np.ndarray] = [np.empty(0, np.int64)] * num_partitions
    for index, domain in enumerate(domains):
        clients = list(range(index, num_partitions, len(domains)))
        members = private[natural == domain]
        if len(clients) == 1:
            partitions[clients[0]] = members.astype(np.int64)
            continue
        # an independent stream per (seed, domain): seed s + 1 must not replay domain i + 1 of s
        stream = int(rng_for(settings.seed, DOMAIN_STREAM, index).integers(1 << 62))
        within = dataclasses.replace(settings, partitioner="dirichlet", seed=stream)
        partitioner = make_partitioner(within, len(clients), "")
        partitioner.dataset = Dataset.from_dict({SAMPLE_ID: members, LABEL: source.labels[members]})
        try:
            for k, client in enumerate(clients):
                ids = partitioner.load_partition(k)[SAMPLE_ID]
                partitions[client] = np.asarray(ids, dtype=np.int64)
        except ValueError as err:
            raise ValueError(
                f"partitioner 'domain-dirichlet' could not split the {len(members)} samples of "
                f"domain '{domain}' over {len(clients)} clients ({err}); use fewer clients or "
                "a larger dirichlet-alpha"
            ) from err
    owners = tuple(_plain(domains[p % len(domains)]) for p in range(num_partitions))
    return tuple(partitions), owners


def _disjoint(
    settings: DataSettings, source: Source, private: np.ndarray, num_partitions: int
) -> tuple[np.ndarray, ...]:
    """Client ``p``: every private sample of block ``p`` of a seeded permutation of the
    classes, ``classes-per-client`` classes a block (in the private samples' order)."""
    labels = source.labels[private]
    classes = np.unique(labels)
    per_client = settings.classes_per_client
    if num_partitions * per_client > len(classes):
        raise ValueError(
            f"partitioner 'disjoint' gives each client {per_client} classes of its own "
            f"(classes-per-client), so {num_partitions} clients need "
            f"{num_partitions * per_client} classes, but dataset '{settings.dataset}' has "
            f"{len(classes)} among its private samples: use fewer clients or classes per "
            "client, or partitioner 'pathological' (clients' classes may overlap)"
        )
    drawn = rng_for(settings.seed, CLASS_DRAW_STREAM).permutation(classes)
    return tuple(
        private[np.isin(labels, drawn[p * per_client : (p + 1) * per_client])].astype(np.int64)
        for p in range(num_partitions)
    )


def make_partitioner(settings: DataSettings, num_partitions: int, natural_column: str) -> Any:
    """The flwr-datasets partitioner named by ``settings.partitioner``."""
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        NaturalIdPartitioner,
        PathologicalPartitioner,
    )

    seed = entropy(settings.seed)
    if settings.partitioner == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if settings.partitioner == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by=LABEL,
            alpha=settings.dirichlet_alpha,
            min_partition_size=MIN_PARTITION_SIZE,
            self_balancing=False,
            shuffle=True,
            seed=seed,
        )
    if settings.partitioner == "pathological":
        return PathologicalPartitioner(
            num_partitions=num_partitions,
            partition_by=LABEL,
            num_classes_per_partition=settings.classes_per_client,
            class_assignment_mode="first-deterministic",
            shuffle=True,
            seed=seed,
        )
    if settings.partitioner == "natural-id":
        return NaturalIdPartitioner(partition_by=natural_column)
    raise ValueError(
        f"partitioner '{settings.partitioner}' unknown; allowed: iid, dirichlet, pathological, "
        "natural-id"
    )


def _natural_ids(settings: DataSettings, source: Source, private: np.ndarray) -> np.ndarray:
    """The natural id of every private sample (synthetic domains dealt round-robin)."""
    if source.synthetic_domains:
        return np.arange(len(private)) % source.synthetic_domains
    if source.natural_ids is None:
        column = source.natural_id_column or settings.natural_id_column
        where = f"column '{column}' is missing" if column else "it has none"
        raise ValueError(
            f"partitioner 'natural-id' needs natural client ids, but dataset "
            f"'{settings.dataset}' {where}: set 'natural-id-column' to a column of the data "
            "(or use the <natural id>/<class>/<image> image-folder layout)"
        )
    return source.natural_ids[private]
