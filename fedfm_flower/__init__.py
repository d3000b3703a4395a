"""fedfm-flower: personalized federated fine-tuning of foundation models on Flower.

The package's folders and their layers: docs/architecture.md. ``lazy_getattr`` lives here, at
the root every module imports anyway, so the light packages' lazy exports import nothing more.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__version__ = "0.1.0"


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) that resolves ``exports`` (name -> module) on first use.

    The ClientApp starts a fresh process per message in deployment and parses the run config
    first; packages whose registries the config reads (``data``, ``models``) must not import
    torch just because one of their light modules is imported.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
