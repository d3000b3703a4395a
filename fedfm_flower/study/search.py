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

A chosen value at an end of its range asks for a wider range, unless that end is the limit of
the key (a weight's 0 or 1, a paper's stated range): ``edge_limit`` says why, from
``TRAINING_LIMITS`` here and the method's ``MethodSpec.search_limits``.

Light: no torch, no flwr, no optuna (``suggest`` receives the trial object).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from fedfm_flower.config.experiment import ConfigError, ExperimentConfig
from fedfm_flower.methods.ranges import (
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
from fedfm_flower.methods.registry import method_spec
from fedfm_flower.methods.settings import coerce

__all__ = [  # the range types, declared in the leaf ``fedfm_flower.methods.ranges``, read here too
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


# The common training keys' ranges, wide enough that no committed table's choice sits at an end
# (each earlier range lies inside, so those studies go on with their trials):
# lr a decade each way -> 30x each way (at the top: FedBABU on glyphs-whole-vit, FedAvg-FT,
# FedDAT and FedDAT-FT on multitask-cpu; at the bottom: pFedPG on glyphs-feature-skew); epochs
# 1-3 -> 1-5 (3 chosen by most methods of the glyph tables, every one of FedPerfix's; FedPerfix
# and FedDPA train 10, pFedPG 5); steps x/÷ 2 -> half to 4x (19-20 of 5-20 on multitask-cpu).
LR_RANGE = Around(30.0, 30.0)
EPOCHS_RANGE = IntRange(1, 5)
STEPS_RANGE = Around(2.0, 4.0)


def training_space(base: Mapping[str, Any]) -> dict[str, Range]:
    """The common training keys every method is tuned over: the learning rate (30x each way of
    the setup's) and the local schedule (epochs 1-5, or half to 4x the steps in step mode)."""
    space: dict[str, Range] = {"lr": LR_RANGE}
    if int(base.get("local-steps", 0)) > 0:
        space["local-steps"] = STEPS_RANGE
    else:
        space["local-epochs"] = EPOCHS_RANGE
    return space


# Ends of a common key's range that are the limit of what the key can take, not a choice of ours
# (key, "bottom" | "top") -> why; a method declares its own keys' in ``MethodSpec.search_limits``.
# None: every end of lr, epochs and steps could move (an epoch or step count at 1 has nothing
# below it, which the report knows of any count).
TRAINING_LIMITS: Mapping[tuple[str, str], str] = {}

EDGES = ("bottom", "top")


def edge_limit(method: str, key: str, end: str) -> str | None:
    """Why ``end`` (``bottom`` or ``top``) of ``key``'s range in the space of ``method`` (or of a
    ``method:variant`` label) is the key's limit (a physical bound, a paper's stated range), or
    None where the end could move."""

    if end not in EDGES:
        raise ValueError(f"an end of a range is one of {', '.join(EDGES)}, got {end!r}")
    limits = {**TRAINING_LIMITS, **dict(method_spec(method.partition(":")[0]).search_limits)}
    return limits.get((key, end))


def method_space(base: Mapping[str, Any]) -> dict[str, Range]:
    """The whole declared space of the base config's method: ``training_space`` and then the
    method's ``MethodSpec.search`` (whose entries win: a method may widen ``lr``)."""

    return {**training_space(base), **dict(method_spec(str(base["method"])).search)}


def resolve_space(space: Mapping[str, Range], base: Mapping[str, Any]) -> dict[str, Resolved]:
    """``space`` in absolute ranges for the run config ``base`` (its setup's values), validated
    as the module docstring says; ``SearchSpaceError`` names the first bad key."""

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
