"""A method's two halves, its Strategy class and its client logic class, imported on demand.

A ``MethodSpec`` names them by ``"module:Class"`` path, so the ClientApp (a fresh process per
message in deployment) imports only its own client module, never server code. They are imported
here and not in ``fedfm_flower.methods.registry``, which the halves themselves read (the split): the
registry stays a leaf of the import graph (``tests/test_architecture.py`` counts these imports
by name as edges from this module).
"""

from __future__ import annotations

import importlib
from typing import Any

from fedfm_flower.methods import MethodSpec
from fedfm_flower.methods.registry import method_spec


def _load(path: str) -> Any:
    """The object a ``"module:name"`` path names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _spec(method: str | MethodSpec) -> MethodSpec:
    """``method``'s spec: itself, or its registry entry when given by name."""
    return method if isinstance(method, MethodSpec) else method_spec(method)


def strategy_class(method: str | MethodSpec) -> Any:
    """The Strategy class of ``method`` (a name, or a spec already looked up)."""
    return _load(_spec(method).strategy)


def client_class(method: str | MethodSpec) -> Any:
    """The client logic class of ``method`` (a name, or a spec already looked up)."""
    return _load(_spec(method).client)
