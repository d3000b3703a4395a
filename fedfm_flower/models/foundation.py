"""The offline foundation models: a ViT (``tiny-vit``, ``small-vit``, ``offline-vit-s``) or a
ResNet (``tiny-resnet``, ``small-resnet``) pretrained on the public split of the configured
dataset, by one recipe for both (AdamW, warm-up and cosine decay).

No client holds a sample of the public split (see ``fedfm_flower.data``), so the backbone is a
stand-in for a model pretrained elsewhere. The weights are cached on disk under
``<cache-dir>/foundation/<key>.safetensors`` with a JSON card beside them (key, accuracy on the
public hold-out, seconds); the key hashes everything that changes the weights (architecture,
image size, dataset, public fraction, epochs, seed), so later runs and every client reuse it.
It is pretrained at the *data* seed (``data-seed``, ``seed`` when that is -1), like tiny-llama
(``models.language``): it stands for a checkpoint pretrained elsewhere, which every run of one
federation shares, so runs that vary only ``seed`` (a tuned table's final runs) vary the
training alone, on the foundation the trials were tuned on. With ``data-seed = -1`` the data
seed is the seed, and the key and weights are those of before.
Pretraining runs at one torch thread whatever the builder's count (``models.threads``), so the
weights do not depend on which process built them. Concurrent builders (Ray actors, SuperNodes
on one host) serialise on a file lock and the file is written atomically, so nobody ever reads a
half-written cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data import load_public_split
from fedfm_flower.models.backbones import OFFLINE_BACKBONES, offline_backbone, pick_device
from fedfm_flower.models.foundation_cards import identified, weights_file_name
from fedfm_flower.models.threads import PRETRAIN_THREADS, pinned_threads
from fedfm_flower.records.durable import (
    DamagedFileError,
    atomic_write_text,
    exclusive_lock,
    load_tensors,
    save_tensors,
)
from fedfm_flower.tasks.classification import ImageClassification
from fedfm_flower.tasks.training import evaluate, train

log = logging.getLogger(__name__)

FOUNDATION_VERSION = 2  # 2: pretrained at PRETRAIN_THREADS (1's caches hold the builder's count)
PRETRAIN_LR = 1e-3
PRETRAIN_WEIGHT_DECAY = 0.05
PRETRAIN_BATCH = 64


def foundation_key(config: ExperimentConfig) -> str:
    """Hash of every setting that changes the pretrained weights of an offline backbone."""

    if config.backbone not in OFFLINE_BACKBONES:
        raise ValueError(
            f"backbone '{config.backbone}' has no offline foundation model (those are "
            f"{', '.join(OFFLINE_BACKBONES)}); its weights come from timm (pretrained, "
            "weights-file) "
            "or are random (pretrained = false)"
        )
    base_dataset = "digits" if config.dataset.startswith("digits") else config.dataset
    fields = {
        "version": FOUNDATION_VERSION,
        "arch": dataclasses.asdict(OFFLINE_BACKBONES[config.backbone]),
        "image_size": config.image_size,
        "dataset": base_dataset,
        "public_fraction": config.public_fraction,
        "epochs": config.pretrain_epochs,
        "seed": config.effective_data_seed,  # the data's seed: runs of one data seed share it
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def foundation_path(config: ExperimentConfig) -> Path:
    """Where the cached weights for ``config`` live."""
    name = weights_file_name(config.backbone, foundation_key(config))
    return config.cache_path / "foundation" / name


def load_foundation_weights(config: ExperimentConfig) -> dict[str, torch.Tensor]:
    """The pretrained offline backbone's state dict, from the cache or pretrained now and
    cached.

    A damaged ``weights-file`` is an error naming the file; a damaged cache is pretrained again.
    """
    if config.weights_file:
        return load_tensors(config.weights_file)
    path = ensure_foundation(config)
    try:
        return load_tensors(path)
    except DamagedFileError as err:
        log.warning("cached foundation model is damaged (%s); pretraining it again", err)
        path.unlink(missing_ok=True)
        return load_tensors(ensure_foundation(config))


def foundation_card(config: ExperimentConfig) -> dict:
    """The JSON card (accuracy, time) of the cached foundation model; builds it if missing."""
    path = ensure_foundation(config)
    return json.loads(path.with_suffix(".json").read_text())


def prepare_offline_backbone(config: ExperimentConfig) -> dict:
    """The vit and resnet families' foundation hook: the card of an offline backbone (built if
    missing) with its build's identity (``foundation_cards``), {} for timm's hub backbones."""

    if config.backbone not in OFFLINE_BACKBONES:
        return {}
    card = foundation_card(config)
    path = foundation_path(config)
    log.info(
        "foundation model %s: public test accuracy %.3f", path.name, card["public_test_accuracy"]
    )
    return identified(card, config.cache_path, [path, path.with_suffix(".json")])


def ensure_foundation(config: ExperimentConfig) -> Path:
    """Pretrain and cache the foundation model unless it is cached; returns its path."""
    path = foundation_path(config)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.with_suffix(".lock")):
        if not path.is_file():  # another process may have built it while we waited
            state, card = pretrain_foundation(config)
            _atomic_save(path, state, card)
    return path


@pinned_threads()
def pretrain_foundation(config: ExperimentConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """Pretrain the offline backbone on the public split; returns its state dict (a ResNet's
    BatchNorm statistics included) and a card."""

    started = time.perf_counter()
    train_set, test_set, num_classes = load_public_split(config)
    torch.manual_seed(config.effective_data_seed)
    backbone = offline_backbone(config)
    model = nn.Sequential(backbone, nn.Linear(backbone.num_features, num_classes))
    device = pick_device(config.device)
    model.to(device)
    recipe = config.replace(
        optimizer="adamw",
        lr=PRETRAIN_LR,
        weight_decay=PRETRAIN_WEIGHT_DECAY,
        batch_size=PRETRAIN_BATCH,
        local_steps=0,
    )
    task = ImageClassification()
    epochs = max(config.pretrain_epochs, 1)
    steps_per_epoch = math.ceil(len(train_set) / PRETRAIN_BATCH)
    warmup = OFFLINE_BACKBONES[config.backbone].warmup_epochs * steps_per_epoch
    stats = train(
        task,
        model,
        train_set,
        model.parameters(),
        recipe,
        seed=config.effective_data_seed,
        epochs=epochs,
        device=device,
        schedule=warmup_cosine(warmup, epochs * steps_per_epoch) if warmup else None,
    )
    result = evaluate(task, model, test_set, device=device)
    card = {
        "key": foundation_key(config),
        "dataset": config.dataset,
        "public_train_examples": len(train_set),
        "public_test_examples": len(test_set),
        "epochs": config.pretrain_epochs,
        "train_accuracy": stats.metrics["accuracy"],
        "public_test_accuracy": result.metrics["accuracy"],
        "torch_threads": PRETRAIN_THREADS,
        "seconds": time.perf_counter() - started,
    }
    log.info(
        "pretrained offline foundation model: public test accuracy %.3f in %.1fs",
        result.metrics["accuracy"],
        card["seconds"],
    )
    if result.metrics["accuracy"] < 2.0 / num_classes:
        log.warning(
            "the offline foundation model %s stayed near chance (public test accuracy %.3f): "
            "results on it mean little; try more pretrain-epochs or another seed",
            config.backbone,
            result.metrics["accuracy"],
        )
    state = {k: v.detach().cpu().contiguous() for k, v in backbone.state_dict().items()}
    return state, card


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Learning-rate multiplier: linear warm-up over ``warmup_steps``, then cosine decay to 0."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(total_steps - warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return multiplier


def _atomic_save(path: Path, state: dict[str, torch.Tensor], card: dict) -> None:
    atomic_write_text(path.with_suffix(".json"), json.dumps(card, indent=2))
    save_tensors(path, state)  # the weights last: their presence says the card is there
