"""``--set KEY=VALUE`` run-config overrides of the sweep and benchmark commands (TOML values)."""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from typing import Any


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["rounds=3", "method='fedrep'", "dataset=digits"]`` -> a dict; bare words are strings."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            overrides[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            overrides[key] = value
    return overrides


def to_set_args(config: dict[str, Any]) -> list[str]:
    """The inverse: ``--set`` arguments for a child benchmark process."""
    args = []
    for key, value in config.items():
        text = value if isinstance(value, str) else str(value).lower()
        args += ["--set", f"{key}={text}" if not isinstance(value, float) else f"{key}={value!r}"]
    return args
