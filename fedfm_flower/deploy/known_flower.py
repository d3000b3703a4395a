"""The Flower versions whose internals the deployment adaptations were checked against.

``fedfm_flower.deploy.supernode`` (short waits, stopped-run pulls, heartbeat) and
``fedfm_flower.deploy.superexec`` (the warm executor, its pulls and task retry) patch or call
Flower code that is not public API; each applies its change only on these versions (and checks
the functions and fields it uses besides), and leaves Flower's behaviour on any other. Flower
1.41 and 1.42 have the same code in every module they touch; a new Flower is added here once
those modules are compared with its source.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Callable
from typing import Any

KNOWN_FLOWER = ("1.41.", "1.42.")


def flower_version() -> str:
    """The installed Flower's version."""
    return importlib.metadata.version("flwr")


def is_known(version: str) -> bool:
    """Whether ``version`` is one of ``KNOWN_FLOWER``'s series."""
    return version.startswith(KNOWN_FLOWER)


def known_versions() -> str:
    """``KNOWN_FLOWER`` for a message: ``1.41.x, 1.42.x``."""
    return ", ".join(version + "x" for version in KNOWN_FLOWER)


def wrap_flower_factory(
    module_name: str, name: str, wrap: Callable[[Any], Any], who: str, lacking: str
) -> bool:
    """Replace factory ``name`` of Flower's module ``module_name`` by ``wrap`` of Flower's own
    (never of an earlier wrapper); False, saying on stderr as ``who`` that ``lacking``, on a
    Flower this was not written against."""
    module = importlib.import_module(module_name)
    make = getattr(module, name, None)
    if not is_known(flower_version()) or make is None:
        return refuse(who, f"{module_name}.{name}", lacking)
    setattr(module, name, wrap(getattr(make, "__wrapped__", make)))
    return True


def refuse(who: str, what: str, consequence: str) -> bool:
    """Say on stderr, as ``who``, that the installed Flower's ``what`` is not the code this was
    written against and what is kept instead (``consequence``); False."""
    print(
        f"{who}: Flower {flower_version()}'s {what} is not the code this knows "
        f"({known_versions()}); {consequence}",
        file=sys.stderr,
    )
    return False
