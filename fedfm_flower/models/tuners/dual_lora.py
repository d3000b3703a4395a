"""FedDPA's dual adapter: a global and a local LoRA on one frozen backbone, mixed per layer.

Every target module gets two peft LoRA adapters of the same rank, alpha and targets, named
``global`` (group ``adapter.global``, federated) and ``local`` (group ``adapter.local``, never
sent). Both are active in every LoRA layer; a layer computes

    h' = W h + w_g * Delta_g h + w_l * Delta_l h,    Delta = (lora_alpha / r) * B A,

so FedDPA-T's training mixture (sec. 4.2), h' = W h + (1 - alpha) Delta_g h + alpha Delta_l h,
is ``w_g = 1 - alpha, w_l = alpha``. The weights multiply peft's per-adapter ``scaling``
(``lora_alpha / r``) inside ``adapter_mix`` and are restored when it exits. Outside any
``adapter_mix`` the model is the global adapter alone (``w_g = 1, w_l = 0``), the adapter
FedDPA federates and embeds instances with (sec. 4.3).

A weight may be a tensor of one weight per batch row: the layer then mixes every row with its
own weights, which is the instance-wise dynamic weighting (``fedfm_flower.models.dynamic_mix``).

Imports inside functions keep ``peft`` out of this module's start-up.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.tuners import TunedParts
from fedfm_flower.models.tuners.lora import inject_lora, lora_patterns

GLOBAL = "global"
LOCAL = "local"
ADAPTERS: tuple[str, str] = (GLOBAL, LOCAL)
# The model as FedDPA federates it: the global adapter alone.
GLOBAL_ONLY: dict[str, float] = {GLOBAL: 1.0, LOCAL: 0.0}

Weight = float | torch.Tensor


def dual_lora_tuner(backbone: nn.Module, config: ExperimentConfig) -> TunedParts:
    """Two LoRA adapters, ``global`` and ``local``, both active, the local one weighted 0."""
    with warnings.catch_warnings():
        # peft warns that a second adapter makes a multi-adapter model: that is the point.
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        backbone = inject_lora(backbone, config, ADAPTERS)
    layers = lora_layers(backbone)
    for layer in layers:
        layer.set_adapter(list(ADAPTERS))  # peft activates only the last adapter it added
    _set_weights(layers, GLOBAL_ONLY)
    return TunedParts(backbone, {}, lora_patterns(ADAPTERS))


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """The peft LoRA layers of ``model`` that hold both FedDPA adapters."""
    from peft.tuners.lora import LoraLayer

    return [
        m
        for m in model.modules()
        if isinstance(m, LoraLayer) and all(a in m.lora_A for a in ADAPTERS)
    ]


@contextlib.contextmanager
def adapter_mix(model: nn.Module, weights: Mapping[str, Weight]) -> Iterator[None]:
    """Within the block every LoRA layer computes ``W h + sum_a weights[a] * Delta_a h``.

    A weight is a float, or a 1-D tensor with one weight per batch row (the inputs of every
    LoRA layer are then ``(batch, tokens, features)``, as in decoder LMs and ViTs).
    """
    unknown = sorted(set(weights) - set(ADAPTERS))
    if unknown:
        raise KeyError(f"unknown adapter(s) {unknown}; FedDPA's adapters: {ADAPTERS}")
    layers = lora_layers(model)
    if not layers:
        raise ValueError("adapter_mix needs a model built with the dual-lora tuner")
    saved = [dict(layer.scaling) for layer in layers]
    try:
        _set_weights(layers, weights)
        yield
    finally:
        for layer, scaling in zip(layers, saved, strict=True):
            layer.scaling.update(scaling)


def _set_weights(layers: list[nn.Module], weights: Mapping[str, Weight]) -> None:
    on_device: dict[tuple[str, torch.device], torch.Tensor] = {}
    for layer in layers:
        for adapter, weight in weights.items():
            base = layer.lora_alpha[adapter] / layer.r[adapter]
            if isinstance(weight, torch.Tensor):
                device = layer.lora_A[adapter].weight.device
                key = (adapter, device)
                if key not in on_device:
                    on_device[key] = weight.detach().to(device, torch.float32).view(-1, 1, 1)
                layer.scaling[adapter] = base * on_device[key]
            else:
                layer.scaling[adapter] = base * float(weight)
