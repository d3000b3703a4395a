"""Building a method's model for a run, its seeded initial trainable tensors (cached on disk by
``fedfm_flower.models.initial_cache``), its foundation model, and a per-process model cache.

The families' builders and foundation hooks (``ModelFamily.builder``, ``.foundation``) are
imported here, on demand, by their ``"module:function"`` paths.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.families import family_of
from fedfm_flower.models.groups import TrainableTensors, TunedModel
from fedfm_flower.models.initial_cache import cached_initial


def build_model(
    config: ExperimentConfig,
    tuner: str,
    num_outputs: int = 0,
    *,
    load_weights: bool = True,
    train_backbone: bool = False,
) -> TunedModel:
    """The configured family's model, tuned by ``tuner``, with seeded trainable tensors
    (the backbone's own weights among them when ``train_backbone``)."""
    build = _resolve(family_of(config.backbone).builder)
    return build(
        config, tuner, num_outputs, load_weights=load_weights, train_backbone=train_backbone
    )


def prepare_foundation(config: ExperimentConfig) -> dict[str, Any]:
    """Build (or find) the cached offline foundation model of ``config``'s backbone, so clients
    never race to build it; its card, or {} when there is none to build (weights from a file,
    an untrained backbone, or a family without a foundation hook)."""
    if not config.pretrained or config.weights_file:
        return {}
    family = family_of(config.backbone)
    return _resolve(family.foundation)(config) if family.foundation else {}


def _resolve(path: str) -> Any:
    """The function a ``"module:function"`` path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@functools.lru_cache(maxsize=2)
def _initial_state(
    config: ExperimentConfig, tuner: str, num_outputs: int, train_backbone: bool
) -> TrainableTensors:
    if train_backbone:  # it starts from its pretrained weights, which every node loads alike
        return build_model(config, tuner, num_outputs, train_backbone=True).trainable()

    def build() -> TrainableTensors:
        return build_model(config, tuner, num_outputs, load_weights=False).trainable()

    return cached_initial(config, tuner, num_outputs, build)


def initial_trainable(
    config: ExperimentConfig, tuner: str, num_outputs: int, *, train_backbone: bool = False
) -> TrainableTensors:
    """The seeded initial trainable tensors and their groups (pretrained weights are loaded
    only when the backbone itself is trainable)."""
    state = _initial_state(config, tuner, num_outputs, train_backbone)
    tensors = {k: v.clone() for k, v in state.tensors.items()}
    return TrainableTensors(tensors, dict(state.groups), dict(state.users))


class ModelCache:
    """Keeps one built model per process so repeated messages do not rebuild the backbone.

    ``get`` resets every trainable tensor to its seeded initial value, so no state leaks from
    one client or round to the next through the cache.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._model: TunedModel | None = None
        self._initial: dict[str, torch.Tensor] = {}

    def get(
        self,
        config: ExperimentConfig,
        tuner: str,
        num_outputs: int,
        device: torch.device,
        *,
        train_backbone: bool = False,
    ) -> TunedModel:
        """The model for ``config`` on ``device`` with trainable tensors at their initial value."""
        key = (config, tuner, num_outputs, str(device), train_backbone)
        if self._key != key or self._model is None:
            model = build_model(config, tuner, num_outputs, train_backbone=train_backbone)
            # An hf-causal-lm loaded with device-map or load-in-4bit is already where its loader
            # put it (``placed``): moving it would undo accelerate's placement, and transformers
            # refuses .to() on 4-bit models. Its adapters sit beside their layers (peft).
            self._model = model if getattr(model, "placed", False) else model.to(device)
            self._initial = dict(self._model.trainable().tensors)
            self._key = key
        self._model.load_tensors(self._initial)
        return self._model


MODEL_CACHE = ModelCache()
