"""Search ranges: the types a method declares its search space with (``MethodSpec.search``).

A leaf: it imports nothing of the project, so ``fedfm_flower.methods`` can declare ranges
without importing ``fedfm_flower.study.search`` (which resolves them against the run config, and so
imports the config and with it the method registry). Their meaning: ``fedfm_flower.study.search``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class Trial(Protocol):
    """What a range needs of a tuning library's trial (Optuna's ``Trial`` has these)."""

    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False) -> float:
        """A float in [low, high]."""

    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False) -> int:
        """An int in [low, high]."""

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        """One of ``choices``."""


@dataclass(frozen=True)
class _Interval:
    """A range between two ends, both included; ``log``: log-scaled."""

    lo: float
    hi: float

    log = False

    def extremes(self) -> tuple[Any, ...]:
        """The values that bound the range."""
        return (self.lo, self.hi)

    def contains(self, value: Any) -> bool:
        """Whether the range can give ``value``."""
        return isinstance(value, int | float) and self.lo <= value <= self.hi


@dataclass(frozen=True)
class LogUniform(_Interval):
    """A float, log-uniform over [lo, hi] (lo > 0)."""

    log = True

    def suggest(self, trial: Trial, key: str) -> float:
        """The trial's value of ``key``."""
        return trial.suggest_float(key, self.lo, self.hi, log=True)


@dataclass(frozen=True)
class Uniform(_Interval):
    """A float, uniform over [lo, hi]."""

    def suggest(self, trial: Trial, key: str) -> float:
        """The trial's value of ``key``."""
        return trial.suggest_float(key, self.lo, self.hi)


@dataclass(frozen=True)
class IntRange(_Interval):
    """An int in [lo, hi], both included; ``log``: log-uniform (lo >= 1)."""

    lo: int
    hi: int
    log: bool = False

    def suggest(self, trial: Trial, key: str) -> int:
        """The trial's value of ``key``."""
        return trial.suggest_int(key, self.lo, self.hi, log=self.log)

    def contains(self, value: Any) -> bool:
        """Whether the range can give ``value`` (an int)."""
        return isinstance(value, int) and self.lo <= value <= self.hi


@dataclass(frozen=True)
class Choice:
    """One of ``values``."""

    values: tuple[Any, ...]

    def suggest(self, trial: Trial, key: str) -> Any:
        """The trial's value of ``key``."""
        return trial.suggest_categorical(key, list(self.values))

    def extremes(self) -> tuple[Any, ...]:
        """Every value."""
        return self.values

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is one of the choices."""
        return value in self.values


@dataclass(frozen=True)
class Around:
    """Log-uniform over [v / down, v * up] of the base config's value v (> 0) of the key."""

    down: float = 10.0
    up: float = 10.0


@dataclass(frozen=True)
class When:
    """``range`` where the base config's ``key`` is one of ``values``; no search elsewhere."""

    range: LogUniform | Uniform | IntRange | Choice | Around
    key: str
    values: tuple[Any, ...]


Range = LogUniform | Uniform | IntRange | Choice | Around | When
Resolved = LogUniform | Uniform | IntRange | Choice
