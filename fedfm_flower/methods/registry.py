"""The method registry: method name -> its ``MethodSpec``, built from ``fedfm_flower.methods``.

Every module of the ``fedfm_flower.methods`` package with a ``SPECS`` tuple contributes its
methods, in module-name order; adding a method adds one module there and edits nothing here.
The package's other modules (``NOT_METHODS``: this registry, the halves' importer and the two
leaves a method module imports) are not discovered.
Specs name their strategy and client classes by import path (``fedfm_flower.methods.halves`` imports
them).

A run's method is resolved once (``resolve``): its spec, its tuner, whether the backbone trains,
its split, and the (shared, local) parameter names of a model's groups, remembered per groups.
The ServerApp resolves once per run and gives the result to the strategy (``RunContext.method``);
a client process resolves once per run config and gives it to every message's runtime
(``ClientRuntime.method``); the resource count resolves once per count. ``tuner_of``,
``trains_backbone`` and ``split_parameters`` answer one question each from the config, for code
that needs only that (the config's checks, benchmarks, tests).

Imports inside functions keep ``torch`` out of this module's start-up.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedfm_flower import methods as _methods_package
from fedfm_flower.methods import MethodSpec, Split
from fedfm_flower.models.families import family_of

NOT_METHODS = frozenset({"registry", "halves", "settings", "ranges"})


def _discover() -> dict[str, MethodSpec]:
    """Every ``SPECS`` entry of the modules of ``fedfm_flower.methods``, by method name."""
    found: dict[str, MethodSpec] = {}
    for module_info in sorted(
        pkgutil.iter_modules(_methods_package.__path__), key=lambda m: m.name
    ):
        if module_info.name in NOT_METHODS:
            continue
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


def _adapts_to_family(spec: MethodSpec, config: Any) -> bool:
    """Whether ``spec`` trains the whole backbone with no tuner of its own (FedBABU, APFL,
    Per-FedAvg) and the run's backbone is of a family that does not train whole (a language
    or multi-modal model), where it trains that family's LoRA instead."""

    return spec.trains_backbone and spec.tuner == "none" and not family_of(config.backbone).whole


def _tuner(spec: MethodSpec, config: Any) -> str:
    """The config's ``tuner`` unless 'auto', else ``spec``'s own (LoRA for a whole-ViT method
    without a tuner on a backbone of another family)."""
    if config.tuner != "auto":
        return config.tuner
    return "lora" if _adapts_to_family(spec, config) else spec.tuner


def _trains_backbone(spec: MethodSpec, config: Any) -> bool:
    """The config says so, or ``spec`` trains the whole ViT (FedPerfix needs one; FedBABU,
    APFL, Per-FedAvg adapt to others)."""
    return config.train_backbone or (spec.trains_backbone and not _adapts_to_family(spec, config))


def tuner_of(config: Any) -> str:
    """The tuner of a run: the config's ``tuner`` unless 'auto', else the method's own (LoRA
    for a whole-ViT method without a tuner on a backbone of another family)."""
    return _tuner(method_spec(config.method), config)


def trains_backbone(config: Any) -> bool:
    """Whether the run trains the backbone's own weights: the config says so, or the method
    trains the whole ViT (FedPerfix needs one; FedBABU, APFL, Per-FedAvg adapt to others)."""
    return _trains_backbone(method_spec(config.method), config)


def settings_class(method: str) -> Any:
    """The MethodSettings class of ``method``, or None when it has no keys of its own."""
    return method_spec(method).settings


def settings_classes() -> tuple[Any, ...]:
    """Every registered MethodSettings class once, in registry order."""
    return tuple(dict.fromkeys(s.settings for s in METHODS.values() if s.settings is not None))


def _split_names(split: Split, groups: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(shared, local) names among ``groups`` that ``split`` selects; a strict split's error
    names its run-config key."""
    from fedfm_flower.models.groups import split_names

    try:
        return split_names(groups, split.shared, split.local, strict=split.strict)
    except ValueError as err:
        if not split.key:
            raise
        raise ValueError(f"run config '{split.key}': {err}") from err


# Distinct group maps a resolved method remembers the names of: a process sees one per model
# and holdings (TAP's clients own subsets), so this bounds a long-lived worker's memory only.
_MAX_REMEMBERED_SPLITS = 64


@dataclass(frozen=True)
class ResolvedMethod:
    """A run's method resolved from its config once: what the strategy and the clients read.

    ``spec`` is the registry entry, ``tuner`` what the model adds to the backbone,
    ``trains_backbone`` whether the backbone's own weights train, ``split`` what clients send
    and keep (the spec's split for this config). ``split_names`` gives the parameter names of
    the split among a model's groups, computed once per distinct groups.
    """

    spec: MethodSpec
    tuner: str
    trains_backbone: bool
    split: Split
    _names: dict[tuple[tuple[str, str], ...], tuple[tuple[str, ...], tuple[str, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def name(self) -> str:
        """The method's registry name."""
        return self.spec.name

    def split_names(self, groups: Mapping[str, str]) -> tuple[list[str], list[str]]:
        """(shared, local) parameter names among ``groups`` (name -> group): what clients send
        and what they keep; fresh lists, remembered per groups."""
        key = tuple(groups.items())
        names = self._names.get(key)
        if names is None:
            shared, local = _split_names(self.split, groups)
            names = (tuple(shared), tuple(local))
            if len(self._names) >= _MAX_REMEMBERED_SPLITS:
                self._names.clear()
            self._names[key] = names
        return list(names[0]), list(names[1])


def resolve(config: Any) -> ResolvedMethod:
    """``config``'s method resolved: one registry lookup, its tuner, whether the backbone
    trains, its split."""
    spec = method_spec(config.method)
    return ResolvedMethod(
        spec=spec,
        tuner=_tuner(spec, config),
        trains_backbone=_trains_backbone(spec, config),
        split=spec.split_for(config),
    )


def split_parameters(config: Any, groups: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(shared, local) parameter names among ``groups`` (name -> group) for ``config``'s method:
    what its clients send and what they keep (``MethodSpec.split``)."""
    return _split_names(method_spec(config.method).split_for(config), groups)
