"""Package exports that import their module on first use (PEP 562 ``__getattr__``).

The ClientApp starts a fresh process per message in deployment and parses the run config
first; packages whose registries the config reads (``data``, ``models``) must not import torch
just because one of their light modules is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves ``exports`` (name -> module) on first use."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
