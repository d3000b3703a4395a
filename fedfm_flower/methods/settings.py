"""How a run-config key is declared and checked, and the typed settings of one method.

``setting(default, doc=..., <rules>)`` declares one key as a dataclass field: its type is the
default's (int, float, bool or str), its rules (``choices``, ``positive``, ``non_negative``,
``within`` with ``bounds``) are checked by ``check_value``, and its one-line ``doc`` is the
meaning docs/configuration.md shows. The common keys are declared so in
``fedfm_flower.config.keys``; ``pyproject.toml``'s run config and the docs' tables are generated
(``fedfm_flower.config.schema``).

A method with keys of its own declares them as a frozen dataclass subclass of
``MethodSettings`` with a ``prefix``: field ``seq_len`` of ``PFedSeqSettings`` (prefix
``pfedseq``) is run-config key ``pfedseq-seq-len``; ``check()`` holds rules across its fields.
Construction validates, so a settings object is always valid. A method module
(``fedfm_flower/methods/<method>.py``) declares the class and names it in its ``MethodSpec``;
``ExperimentConfig`` carries every registered method's values and
``config.settings_of(PFedSeqSettings)`` returns the typed object.

This module and the settings modules import neither torch nor flwr: the ClientApp parses the
run config in a fresh process per message.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any, ClassVar, Protocol, Self, TypeVar

SCALARS: tuple[type, ...] = (bool, int, float, str)


class ConfigError(ValueError):
    """A run-config value that is not allowed; the message names key, value and rule."""

    def __init__(self, key: str, value: Any, allowed: str, source: str = "run config") -> None:
        super().__init__(f"{source} '{key}' = {value!r} is invalid: {allowed}")
        self.key = key
        self.value = value


FINITE = "must be a finite number (TOML's nan and inf are not allowed)"


def require_finite(key: str, value: Any, source: str = "run config") -> None:
    """A ConfigError naming ``key`` when ``value`` is a float NaN or infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, value, FINITE, source=source)


def require_package(key: str, value: Any, package: str, needs: str = "") -> None:
    """A ConfigError naming ``key`` when ``package`` cannot be imported (nothing is imported)."""

    if find_spec(package) is None:
        what = f"needs the {package} package{needs}"
        raise ConfigError(key, value, f"{what}; {package} is not installed (pip install {package})")


def coerce(key: str, raw: Any, kind: type, source: str = "run config") -> Any:
    """Convert a TOML/CLI value to the field's type, or fail naming the key (and ``source``);
    a float must be finite."""
    if kind is float and not isinstance(raw, bool):
        try:
            value = float(raw)
        except (TypeError, ValueError):
            pass
        else:
            require_finite(key, value, source)
            return value
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("true", "false"):
                return raw.lower() == "true"
            raise ValueError
        if kind is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if kind is str:
            return str(raw)
    except (TypeError, ValueError):
        pass
    raise ConfigError(key, raw, f"expected a value of type {kind.__name__}", source=source)


Choices = tuple[str, ...] | Callable[[], tuple[str, ...]]
BOUNDS: tuple[str, ...] = ("[]", "(]", "[)", "()")  # which ends of ``within`` are included


def setting(
    default: Any,
    *,
    doc: str = "",
    choices: Choices | None = None,
    positive: bool = False,
    non_negative: bool = False,
    within: tuple[float, float] | None = None,
    bounds: str = "[]",
    note: str = "",
    example: Any = None,
) -> Any:
    """A run-config key: its default, the rules its value must satisfy and what it means.

    ``doc``: the one-line meaning (the docs' key tables are generated from it); ``choices``:
    the allowed values, or a function returning them (read from a registry when checked);
    ``positive``: > 0; ``non_negative``: >= 0; ``within``: ``(lo, hi)`` with ``bounds`` saying
    which ends are included (``"[]"`` both, ``"(]"``, ``"[)"``, ``"()"``). ``note`` is appended
    to the ``within`` error (why the range). ``example``: a valid value other than the default,
    for a free-form string (tests use it).
    """
    if not isinstance(default, SCALARS):
        raise TypeError(f"a setting's default must be int, float, bool or str, got {default!r}")
    if bounds not in BOUNDS:
        raise ValueError(f"bounds must be one of {', '.join(BOUNDS)}, got {bounds!r}")
    rules = {"choices": choices, "positive": positive, "non_negative": non_negative}
    metadata = {**rules, "within": within, "bounds": bounds, "note": note}
    return dataclasses.field(default=default, metadata={**metadata, "doc": doc, "example": example})


def allowed_values(field: dataclasses.Field) -> tuple[str, ...] | None:
    """The values ``field`` allows (its ``choices`` resolved), or None when any value goes."""
    choices = field.metadata.get("choices")
    return choices() if callable(choices) else choices


def check_value(key: str, value: Any, field: dataclasses.Field) -> None:
    """Raise ConfigError naming ``key``, ``value`` and the first of ``field``'s rules it breaks."""
    rules = field.metadata
    require_finite(key, value)
    if isinstance(value, str) and "\x00" in value:  # no path, name or choice holds one
        raise ConfigError(key, value, "must not contain a NUL character")
    choices = allowed_values(field)
    if choices is not None and value not in choices:
        raise ConfigError(key, value, f"allowed: {', '.join(choices)}")
    if rules.get("positive") and not value > 0:
        raise ConfigError(key, value, "must be > 0")
    if rules.get("non_negative") and value < 0:
        raise ConfigError(key, value, "must be >= 0")
    if rules.get("within") is not None:
        lo, hi = rules["within"]
        opening, closing = rules.get("bounds", "[]")
        above = lo <= value if opening == "[" else lo < value
        below = value <= hi if closing == "]" else value < hi
        if not (above and below):
            note = f" ({rules['note']})" if rules.get("note") else ""
            raise ConfigError(key, value, f"must lie in {opening}{lo}, {hi}{closing}{note}")


@dataclass(frozen=True)
class MethodSettings:
    """Base of a method's typed settings; subclasses set ``prefix`` and declare fields."""

    prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ keys and defaults
    @classmethod
    def key_of(cls, name: str) -> str:
        """Run-config key of field ``name``: ``<prefix>-<name in kebab case>``, a trailing
        underscore dropped (``lambda_``, a field named after a Python keyword)."""
        return f"{cls.prefix}-{name.rstrip('_').replace('_', '-')}"

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """This method's run-config keys, in declaration order."""
        return tuple(cls.key_of(f.name) for f in dataclasses.fields(cls))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Run-config key -> default, in declaration order."""
        return {cls.key_of(f.name): f.default for f in dataclasses.fields(cls)}

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> Self:
        """The settings from this method's keys of ``run_config`` (coerced, validated).

        Keys of this method that are missing take their default; every other key is ignored
        (``ExperimentConfig.from_run_config`` rejects unknown keys).
        """
        values = {}
        for f in dataclasses.fields(cls):
            key = cls.key_of(f.name)
            if key in run_config:
                values[f.name] = coerce(key, run_config[key], type(f.default))
        return cls(**values)

    def to_run_config(self) -> dict[str, Any]:
        """Run-config key -> value."""
        return {self.key_of(f.name): getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> Self:
        """A validated copy with some fields changed (field names, without the prefix)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError naming the first value that breaks its field's rules or check()."""
        for f in dataclasses.fields(self):
            check_value(self.key_of(f.name), getattr(self, f.name), f)
        self.check()

    def check(self) -> None:
        """Rules across fields (override; raise ConfigError). None by default."""


SettingsT = TypeVar("SettingsT", bound=MethodSettings)


class RunConfig(Protocol):
    """A run's config as the layers under ``fedfm_flower.config.experiment`` read it: the method
    modules, the registry and the privacy capabilities, which the config imports and so
    cannot import (``ExperimentConfig`` is one)."""

    method: str
    dataset: str
    dp: str
    num_clients: int

    def settings_of(self, kind: type[SettingsT]) -> SettingsT:
        """The typed settings ``kind`` of the run's values."""
        ...
