"""The method registry: method name -> its ``MethodSpec``, built from ``fedfm_flower.methods``.

Every module of the ``fedfm_flower.methods`` package with a ``SPECS`` tuple contributes its
methods, in module-name order; adding a method adds one module there and edits nothing here.
Specs name their strategy and client classes by import path (``fedfm_flower.halves`` imports
them). What a method shares and keeps is read here (``split_parameters``) by the strategy, the
client and the resource count alike.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from fedfm_flower import methods as _methods_package
from fedfm_flower.methods import MethodSpec, Split


def _discover() -> dict[str, MethodSpec]:
    """Every ``SPECS`` entry of the modules of ``fedfm_flower.methods``, by method name."""
    found: dict[str, MethodSpec] = {}
    for module_info in sorted(
        pkgutil.iter_modules(_methods_package.__path__), key=lambda m: m.name
    ):
        module = importlib.import_module(f"{_methods_package.__name__}.{module_info.name}")
        for spec in getattr(module, "SPECS", ()):
            if not isinstance(spec, MethodSpec):
                raise TypeError(f"{module.__name__}.SPECS holds {spec!r}, not a MethodSpec")
            if spec.name in found:
                raise TypeError(f"method '{spec.name}' is declared twice ({module.__name__})")
            found[spec.name] = spec
    return found


METHODS: dict[str, MethodSpec] = _discover()


def method_spec(method: str) -> MethodSpec:
    """The registry entry of ``method``, or a ValueError naming the allowed methods."""
    if method not in METHODS:
        raise ValueError(f"method '{method}' unknown; allowed: {', '.join(METHODS)}")
    return METHODS[method]


def _adapts_to_family(config: Any) -> bool:
    """Whether the run's method trains the whole ViT with no tuner of its own (FedBABU, APFL,
    Per-FedAvg) on a backbone of another family, where it trains that family's LoRA instead."""
    from fedfm_flower.models.families import family_of

    spec = method_spec(config.method)
    return (
        spec.trains_backbone and spec.tuner == "none" and family_of(config.backbone).name != "vit"
    )


def tuner_of(config: Any) -> str:
    """The tuner of a run: the config's ``tuner`` unless 'auto', else the method's own (LoRA
    for a whole-ViT method without a tuner on a backbone of another family)."""
    if config.tuner != "auto":
        return config.tuner
    return "lora" if _adapts_to_family(config) else method_spec(config.method).tuner


def trains_backbone(config: Any) -> bool:
    """Whether the run trains the backbone's own weights: the config says so, or the method
    trains the whole ViT (FedPerfix needs one; FedBABU, APFL, Per-FedAvg adapt to others)."""
    spec = method_spec(config.method)
    return config.train_backbone or (spec.trains_backbone and not _adapts_to_family(config))


def settings_class(method: str) -> Any:
    """The MethodSettings class of ``method``, or None when it has no keys of its own."""
    return method_spec(method).settings


def settings_classes() -> tuple[Any, ...]:
    """Every registered MethodSettings class once, in registry order."""
    return tuple(dict.fromkeys(s.settings for s in METHODS.values() if s.settings is not None))


def split_parameters(config: Any, groups: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(shared, local) parameter names among ``groups`` (name -> group) for ``config``'s method:
    what its clients send and what they keep (``MethodSpec.split``)."""
    from fedfm_flower.models.groups import split_names

    split: Split = method_spec(config.method).split_for(config)
    try:
        return split_names(groups, split.shared, split.local, strict=split.strict)
    except ValueError as err:
        if not split.key:
            raise
        raise ValueError(f"run config '{split.key}': {err}") from err
