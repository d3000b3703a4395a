"""The seeded initial trainable tensors of a model, cached on disk for the ServerApp.

A strategy starts from the trainable tensors every client builds from the run's seed, so the
ServerApp needs their values, names and groups before round 1. Building the model for them
imports timm and peft and builds the backbone: for the main job on two cores, 2-2.5 CPU s of
the ServerApp's start, which is ready 4.5 s earlier without it (docs/benchmarks.md, start-up).
The first build writes them to ``<cache-dir>/initial/<backbone>-<key>.safetensors`` with a JSON
file beside it (names in model order, groups, users); later runs read them back and import
neither timm nor peft. Clients still build the model (they need the backbone).

The key hashes
- every run-config key except ``INERT_KEYS``, those that never reach the model (rounds,
  sampling, local training, outputs, trackers, privacy, secure aggregation; a test changes
  each one and checks that the built tensors stay bit-identical);
- the tuner and the number of outputs;
- the installed versions of torch, timm, peft and transformers (their initialisations draw
  from the seeded generator);
- the source of this package (``SOURCE_ROOT``): any change of its code starts a new entry.

A model whose backbone trains is never cached (its pretrained weights are among its trainable
tensors). A damaged entry (tensors that fail their digest, a JSON that does not match them) is
built again and replaced; a cache directory that cannot be written costs only the build.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
from collections.abc import Callable
from pathlib import Path

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.config.keys import OutputKeys, PrivacyKeys, SecAggKeys, TrackerKeys, TrainingKeys
from fedfm_flower.models.groups import TrainableTensors
from fedfm_flower.records.durable import (
    DamagedFileError,
    atomic_write_text,
    exclusive_lock,
    load_tensors,
    save_tensors,
)

log = logging.getLogger(__name__)

CACHE_VERSION = 1
SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the fedfm_flower package
LIBRARIES = ("torch", "timm", "peft", "transformers")
_INERT_GROUPS = (TrainingKeys, OutputKeys, TrackerKeys, PrivacyKeys, SecAggKeys)
# Run-config keys that never reach a model's construction; all others are in the key.
INERT_KEYS: frozenset[str] = frozenset(
    {
        "num-server-rounds",
        "fraction-train",
        "fraction-evaluate",
        "min-train-clients",
        "sample-per-task",
        "eval-every",
        "fused-evaluation",
        "prompt-replies",
        "round-timeout",
        "max-failed-rounds",
        "cache-dir",  # where the entry lives, not what it holds
        *(f.name.replace("_", "-") for group in _INERT_GROUPS for f in dataclasses.fields(group)),
    }
)


@functools.cache
def source_digest(root: Path = SOURCE_ROOT) -> str:
    """sha256 of every ``.py`` file under ``root``, with its relative path, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = ""
    return versions


def initial_key(config: ExperimentConfig, tuner: str, num_outputs: int) -> str:
    """The cache key of the initial trainable tensors of ``config``'s model (hex, 16 digits)."""
    fields = {
        "version": CACHE_VERSION,
        "config": {k: v for k, v in sorted(config.to_run_config().items()) if k not in INERT_KEYS},
        "tuner": tuner,
        "num_outputs": num_outputs,
        "libraries": _library_versions(),
        "source": source_digest(),
    }
    encoded = json.dumps(fields, sort_keys=True, default=repr).encode()
    return hashlib.sha256(encoded).hexdigest()[:16]


def initial_path(config: ExperimentConfig, tuner: str, num_outputs: int) -> Path:
    """Where the initial trainable tensors of ``config``'s model are cached."""
    name = f"{config.backbone}-{initial_key(config, tuner, num_outputs)}.safetensors"
    return config.cache_path / "initial" / name


def read_initial(path: Path) -> TrainableTensors:
    """The cached entry at ``path``; ``DamagedFileError`` (or ``OSError`` when it is missing)."""
    tensors = load_tensors(path, own=True)
    try:
        layout = json.loads(path.with_suffix(".json").read_text())
        names, groups = layout["names"], layout["groups"]
        users = {n: frozenset(u) for n, u in layout["users"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise DamagedFileError(path.with_suffix(".json"), f"not a layout: {err}") from err
    if sorted(names) != sorted(tensors) or set(groups) != set(names):
        raise DamagedFileError(path.with_suffix(".json"), "its names differ from the tensors'")
    return TrainableTensors({n: tensors[n] for n in names}, groups, users)


def write_initial(path: Path, initial: TrainableTensors) -> None:
    """Write ``initial`` to ``path`` (tensors, then the layout beside them), each atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors(path, dict(initial.tensors))
    layout = {
        "names": list(initial.tensors),
        "groups": dict(initial.groups),
        "users": {n: sorted(u) for n, u in initial.users.items()},
    }
    atomic_write_text(path.with_suffix(".json"), json.dumps(layout, indent=1) + "\n")


def cached_initial(
    config: ExperimentConfig,
    tuner: str,
    num_outputs: int,
    build: Callable[[], TrainableTensors],
) -> TrainableTensors:
    """The initial trainable tensors from the cache, else from ``build()`` (then cached)."""
    path = initial_path(config, tuner, num_outputs)
    if path.with_suffix(".json").is_file():  # written last: an entry is whole once it exists
        try:
            return read_initial(path)
        except OSError as err:  # DamagedFileError included
            log.warning("cached initial tensors are damaged (%s); building them again", err)
    initial = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(path.with_suffix(".lock")):
            write_initial(path, initial)  # a writer that waited for the lock writes it again
    except OSError as err:
        log.warning("initial tensors not cached in %s: %s", path.parent, err)
    return initial
