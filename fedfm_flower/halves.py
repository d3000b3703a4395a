"""A method's two halves, its Strategy class and its client logic class, imported on demand.

A ``MethodSpec`` names them by ``"module:Class"`` path, so the ClientApp (a fresh process per
message in deployment) imports only its own client module, never server code. They are imported
here and not in ``fedfm_flower.registry``, which the halves themselves read (the split): the
registry stays a leaf of the import graph (``tests/test_architecture.py`` counts these imports
by name as edges from this module).
"""

from __future__ import annotations

import importlib
from typing import Any

from fedfm_flower.registry import method_spec


def _load(path: str) -> Any:
    """The object a ``"module:name"`` path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def strategy_class(method: str) -> Any:
    """The Strategy class of ``method``."""
    return _load(method_spec(method).strategy)


def client_class(method: str) -> Any:
    """The client logic class of ``method``."""
    return _load(method_spec(method).client)
