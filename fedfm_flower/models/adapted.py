"""A frozen backbone with a parameter-efficient tuner and a classification head.

The tuner is the method's (``fedfm_flower.registry.MethodSpec.tuner``): ``lora`` injects LoRA
adapters through peft; ``vpt`` / ``vpt-deep`` insert visual prompts
(``fedfm_flower.models.prompts``). Parameter groups, by name of ``named_parameters()``:

* ``adapter``: every ``lora_A``/``lora_B`` weight injected by peft into the target modules;
* ``prompt``: the visual prompts ``prompts.embeddings``, shape (depth or 1, K, width);
* ``head``: the linear classifier ``head.weight``/``head.bias``;
* everything else is the backbone, frozen (``requires_grad=False``) and never sent anywhere.

All trainable tensors are initialised from ``config.seed`` so the server and every client start
from the same adapter and head, which FedAvg-style aggregation needs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from fedfm_flower.config import ExperimentConfig
from fedfm_flower.models.backbones import build_backbone, freeze
from fedfm_flower.models.prompts import VisualPrompts
from fedfm_flower.registry import method_spec

GROUPS: tuple[str, ...] = ("adapter", "prompt", "head")


def parameter_group(name: str) -> str:
    """The group ('adapter', 'prompt', 'head' or 'backbone') a parameter name belongs to."""
    if "lora_" in name:
        return "adapter"
    if name.startswith("prompts."):
        return "prompt"
    if name.startswith("head."):
        return "head"
    return "backbone"


class AdaptedClassifier(nn.Module):
    """Frozen backbone + the method's tuner (LoRA or visual prompts) + linear head."""

    def __init__(self, backbone: nn.Module, num_classes: int, config: ExperimentConfig) -> None:
        super().__init__()
        freeze(backbone)
        self.prompts: VisualPrompts | None = None
        tuner = method_spec(config.method).tuner
        if tuner == "lora":
            self.backbone = _inject_lora(backbone, config)
        else:
            self.backbone = backbone
            self.prompts = VisualPrompts(backbone, config.vpt_num_prompts, deep=tuner == "vpt-deep")
        self.head = nn.Linear(backbone.num_features, num_classes)
        self._index: list[tuple[str, nn.Parameter, str]] | None = None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        if self.prompts is not None:
            return self.head(self.prompts.features(self.backbone, images))
        return self.head(self.backbone(images))

    def group_parameters(self, groups: Iterable[str]) -> dict[str, nn.Parameter]:
        """Named parameters of the given groups, in model order."""
        wanted = set(groups)
        unknown = wanted - set(GROUPS)
        if unknown:
            raise ValueError(f"unknown parameter groups {sorted(unknown)}; allowed: {GROUPS}")
        if self._index is None:
            # Walking every module for named_parameters() cost ~1 ms per call and a message
            # makes several calls: the (name, parameter, group) list is built once.
            self._index = [(n, p, parameter_group(n)) for n, p in self.named_parameters()]
        return {n: p for n, p, group in self._index if group in wanted}

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        self._index = None  # .to() / .half() may replace parameters
        return super()._apply(fn, recurse)

    def group_tensors(self, groups: Iterable[str]) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the given groups' parameters."""
        return {n: p.detach().cpu().clone() for n, p in self.group_parameters(groups).items()}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy named tensors into trainable parameters; unknown names are an error."""
        params = self.group_parameters(GROUPS)
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise KeyError(f"no trainable parameter named {unknown[:3]}")
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))


def _inject_lora(backbone: nn.Module, config: ExperimentConfig) -> nn.Module:
    """``backbone`` with peft LoRA adapters in ``lora-target-modules``."""
    from peft import LoraConfig, inject_adapter_in_model

    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.target_modules,
    )
    try:
        return inject_adapter_in_model(lora, backbone)
    except ValueError as err:
        raise ValueError(
            f"run config 'lora-target-modules' = {config.lora_target_modules!r} is invalid "
            f"for backbone '{config.backbone}': {err}"
        ) from err


def build_model(
    config: ExperimentConfig, num_classes: int, *, load_weights: bool = True
) -> AdaptedClassifier:
    """A fresh AdaptedClassifier with seeded adapter and head initialisation."""
    with torch.random.fork_rng(devices=[]):
        # A backbone without pretrained weights must still be identical on every node.
        torch.manual_seed(config.seed + 2)
        backbone = build_backbone(config, load_weights=load_weights)
        torch.manual_seed(config.seed)
        model = AdaptedClassifier(backbone, num_classes, config)
        # peft zero-initialises lora_B, so the adapter starts as the identity update.
        torch.manual_seed(config.seed + 1)
        model.head.reset_parameters()
    return model


@functools.lru_cache(maxsize=2)
def _initial_state(config: ExperimentConfig, num_classes: int) -> dict[str, torch.Tensor]:
    model = build_model(config, num_classes, load_weights=False)
    return model.group_tensors(GROUPS)


def initial_trainable(config: ExperimentConfig, num_classes: int) -> dict[str, torch.Tensor]:
    """The seeded initial adapter and head, without loading any pretrained weights."""
    return {k: v.clone() for k, v in _initial_state(config, num_classes).items()}


class ModelCache:
    """Keeps one built model per process so repeated messages do not rebuild the backbone.

    ``get`` resets every trainable tensor to its seeded initial value, so no state leaks from
    one client or round to the next through the cache.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._model: AdaptedClassifier | None = None
        self._initial: dict[str, torch.Tensor] = {}

    def get(
        self, config: ExperimentConfig, num_classes: int, device: torch.device
    ) -> AdaptedClassifier:
        """The model for ``config`` on ``device`` with trainable tensors at their initial value."""
        key = (config, num_classes, str(device))
        if self._key != key or self._model is None:
            self._model = build_model(config, num_classes).to(device)
            self._initial = self._model.group_tensors(GROUPS)
            self._key = key
        self._model.load_tensors(self._initial)
        return self._model


MODEL_CACHE = ModelCache()
