"""Search spaces: which run-config keys a method is tuned over, and over what ranges.

A method declares the ranges of its own keys in its ``MethodSpec.search`` (next to its
settings, ``fedfm_flower/methods/<method>.py``); the common training keys every method is tuned
over are ``training_space`` here, so every method gets the same ones. A range is one of:

- ``LogUniform(lo, hi)`` / ``Uniform(lo, hi)``: a float;
- ``IntRange(lo, hi)``: an int, both ends included;
- ``Choice(values)``: one of the values (any scalar type);
- ``Around(down, up)``: log-uniform over ``[v / down, v * up]`` where ``v`` is the setup's own
  value of the key (``lr``: a setup's learning rate sets the scale; an int key gives ints).
- ``When(range, key, values)``: ``range``, searched only where the base config's ``key`` is one of
  ``values`` (a key that changes nothing otherwise is left out rather than searched in vain).

``resolve_space`` turns a declared space into absolute ranges for one base run config and
validates it: every key must be a run-config key of the right type, every range non-empty,
and every extreme value (each end, each choice) must pass the run config's own validation, so
a range that would give an invalid run fails before the first trial, naming key and value.

Light: no torch, no flwr, no optuna (``suggest`` receives the trial object).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from fedfm_flower.ranges import (
    Around,
    Choice,
    IntRange,
    LogUniform,
    Range,
    Resolved,
    Trial,
    Uniform,
    When,
)

__all__ = [  # the range types, declared in the leaf ``fedfm_flower.ranges``, read here too
    "Around",
    "Choice",
    "IntRange",
    "LogUniform",
    "Range",
    "Resolved",
    "Trial",
    "Uniform",
    "When",
]


class SearchSpaceError(ValueError):
    """A search space that cannot be searched; the message names the key and the value."""


def training_space(base: Mapping[str, Any]) -> dict[str, Range]:
    """The common training keys every method is tuned over: the learning rate (a decade each
    way of the setup's) and the local schedule (epochs 1-3, or steps x/÷ 2 in step mode)."""
    space: dict[str, Range] = {"lr": Around(10.0, 10.0)}
    if int(base.get("local-steps", 0)) > 0:
        space["local-steps"] = Around(2.0, 2.0)
    else:
        space["local-epochs"] = IntRange(1, 3)
    return space


def method_space(base: Mapping[str, Any]) -> dict[str, Range]:
    """The whole declared space of the base config's method: ``training_space`` and then the
    method's ``MethodSpec.search`` (whose entries win: a method may widen ``lr``)."""
    from fedfm_flower.registry import method_spec

    return {**training_space(base), **dict(method_spec(str(base["method"])).search)}


def resolve_space(space: Mapping[str, Range], base: Mapping[str, Any]) -> dict[str, Resolved]:
    """``space`` in absolute ranges for the run config ``base`` (its setup's values), validated
    as the module docstring says; ``SearchSpaceError`` names the first bad key."""
    from fedfm_flower.config import ConfigError, ExperimentConfig
    from fedfm_flower.settings import coerce

    defaults = ExperimentConfig().to_run_config()
    full = {**defaults, **base}
    resolved: dict[str, Resolved] = {}
    for key, declared in space.items():
        if key not in defaults:
            raise SearchSpaceError(f"search space key '{key}' is not a run-config key")
        if isinstance(declared, When):
            if declared.key not in defaults:
                raise SearchSpaceError(
                    f"search space '{key}' depends on '{declared.key}', not a run-config key"
                )
            if full[declared.key] not in declared.values:
                continue
            declared = declared.range
        kind = type(defaults[key])
        rng = _absolute(key, declared, full[key], kind)
        _check_range(key, rng, kind)
        for value in rng.extremes():
            try:
                coerced = coerce(key, value, kind, source="search space")
                ExperimentConfig.from_run_config({**full, key: coerced})
            except ConfigError as err:
                raise SearchSpaceError(
                    f"search space '{key}' reaches {value!r}, which the run config refuses: {err}"
                ) from err
        resolved[key] = rng
    return resolved


def _absolute(key: str, declared: Range, value: Any, kind: type) -> Resolved:
    if not isinstance(declared, Around):
        return declared
    if kind not in (int, float) or isinstance(value, bool) or not value > 0:
        raise SearchSpaceError(
            f"search space '{key}' = Around(...) needs the setup's value > 0, got {value!r}"
        )
    if not (declared.down >= 1 and declared.up >= 1):
        raise SearchSpaceError(f"search space '{key}': Around factors must be >= 1: {declared}")
    if kind is int:
        lo, hi = max(1, math.floor(value / declared.down)), math.ceil(value * declared.up)
        return IntRange(lo, hi, log=True)
    return LogUniform(value / declared.down, value * declared.up)


def _check_range(key: str, rng: Resolved, kind: type) -> None:
    if isinstance(rng, Choice):
        if not rng.values:
            raise SearchSpaceError(f"search space '{key}' has no choices")
        return
    wanted = int if isinstance(rng, IntRange) else float
    if kind is not wanted and not (kind is float and wanted is int):
        raise SearchSpaceError(
            f"search space '{key}' is a {type(rng).__name__} range, but the key holds "
            f"{kind.__name__} values"
        )
    if not rng.lo < rng.hi:
        raise SearchSpaceError(f"search space '{key}' is empty: [{rng.lo}, {rng.hi}]")
    if rng.log and not rng.lo > 0:
        raise SearchSpaceError(f"search space '{key}' is log-scaled but starts at {rng.lo}")


def suggest(trial: Trial, space: Mapping[str, Resolved]) -> dict[str, Any]:
    """The trial's run-config values for every key of ``space`` (in declaration order)."""
    return {key: rng.suggest(trial, key) for key, rng in space.items()}


def setup_values(space: Mapping[str, Resolved], base: Mapping[str, Any]) -> dict[str, Any]:
    """The base run config's own values of the keys of ``space`` that their ranges can give
    (a tuning study's first trial: the untuned run, on validation data)."""
    from fedfm_flower.config import ExperimentConfig

    full = {**ExperimentConfig().to_run_config(), **base}
    return {key: full[key] for key, rng in space.items() if rng.contains(full[key])}


def describe(rng: Resolved) -> str:
    """A short text of a range for reports (``log-uniform [0.002, 0.2]``)."""
    if isinstance(rng, Choice):
        return "one of " + ", ".join(map(str, rng.values))
    scale = "log-" if isinstance(rng, LogUniform) or getattr(rng, "log", False) else ""
    kind = "int" if isinstance(rng, IntRange) else "uniform"
    return f"{scale}{kind} [{rng.lo:g}, {rng.hi:g}]"


_DESCRIBED = re.compile(r"^(log-)?(?:int|uniform) \[([^,\]]+), ([^\]]+)\]$")


def space_position(value: Any, description: str) -> float | None:
    """Where ``value`` lies in the range ``describe`` wrote as ``description``: 0 at its low
    end, 1 at its high end, on the range's scale (log or linear); None for a choice, another
    text or a value that is not a number."""
    match = _DESCRIBED.match(description)
    if match is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    log, lo, hi = bool(match.group(1)), float(match.group(2)), float(match.group(3))
    if log:
        if value <= 0:
            return None
        value, lo, hi = math.log(value), math.log(lo), math.log(hi)
    return (value - lo) / (hi - lo) if hi > lo else None


# States of a tuning trial whose values were tried: it ran and gave a validation value.
TRIED_STATES: tuple[str, ...] = ("complete", "pruned")


def tried_ranges(trials: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per key, what the ``trials`` (``tuning.json`` trial records) that ran tried: ``lo`` and
    ``hi`` of a numeric key, the sorted distinct ``values`` of another."""
    seen: dict[str, list[Any]] = {}
    for trial in trials:
        if trial["state"] in TRIED_STATES:
            for key, value in trial["values"].items():
                seen.setdefault(key, []).append(value)
    return {key: _tried(values) for key, values in seen.items()}


def _tried(values: list[Any]) -> dict[str, Any]:
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return {"lo": min(values), "hi": max(values)}
    return {"values": sorted(set(values), key=str)}


def outside_tried(value: Any, tried: Mapping[str, Any]) -> bool:
    """Whether ``value`` lies outside a key's ``tried_ranges`` entry ``tried``."""
    if "values" in tried:
        return value not in tried["values"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    return not tried["lo"] <= value <= tried["hi"]


def describe_tried(tried: Mapping[str, Any]) -> str:
    """A short text of a ``tried_ranges`` entry (``0.0021-0.047``, ``{1, 3}``)."""
    if "values" in tried:
        return "{" + ", ".join(map(str, tried["values"])) + "}"
    return f"{tried['lo']:.4g}-{tried['hi']:.4g}"
