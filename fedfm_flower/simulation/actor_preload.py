"""Simulation actors that load the ClientApp's heavy imports while the run starts.

In Flower's Ray simulation each actor process imports torch, timm, peft and the project's client
code on the first message it runs, so round 1 waits for those imports (seconds per actor) after
the ServerApp has already spent seconds loading its own. Flower's actor takes an
``on_actor_init_fn`` that runs when the actor is created (``ClientAppActor.__init__``), which is
while the ServerApp still starts; its backend only ever passes one for TensorFlow.

``install`` wraps ``RayBackend.build`` in the simulation process so that, unless the backend
config set one, every actor is created with ``on_actor_init_fn=preload``; ``preload`` imports
``PRELOADED`` in the actor (pickled by reference: the actor imports this module). Only when and
where the imports happen changes; what the ClientApp computes does not. A module that fails to
import is skipped (the first message then fails with the real error). Guarded like
``fedfm_flower.simulation.prompt_engine``: installed only on the sources of Flower's functions this
module knows (``FLOWER_SOURCES``, Flower 1.42.0); ``FEDFM_ACTOR_PRELOAD=0`` leaves Flower's as is.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from fedfm_flower.simulation.prompt_engine import unknown_sources

log = logging.getLogger("fedfm_flower")

BACKEND_MODULE = "flwr.server.superlink.fleet.vce.backend.raybackend"
ACTOR_MODULE = "flwr.simulation.ray_transport.ray_actor"
ENGINE_MODULE = "flwr.server.superlink.fleet.vce.vce_api"  # loaded only in the simulation process
ENV_SWITCH = "FEDFM_ACTOR_PRELOAD"
# What a ClientApp's first train or evaluate message imports, heaviest first: torch, the ViT
# family's timm, peft (LoRA; it also loads transformers) and the client code on top of them.
PRELOADED: tuple[str, ...] = (
    "torch",
    "timm.models.vision_transformer",
    "peft",
    "client_apps.base",
    "fedfm_flower.methods.halves",
)
# sha256 (first 16 hex digits) of inspect.getsource of what this module relies on, by name.
FLOWER_SOURCES = {
    "RayBackend.build": {"6a0c387457a6dbc1"},
    "ClientAppActor.__init__": {"75f92c33be853d91"},
}


def preload(modules: tuple[str, ...] = PRELOADED) -> dict[str, float]:
    """Import ``modules`` (each that fails is skipped); seconds per module imported."""
    seconds: dict[str, float] = {}
    for name in modules:
        started = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - the first message reports the real failure
            log.debug("actor preload: %s not imported: %s", name, err)
            continue
        seconds[name] = time.perf_counter() - started
    return seconds


def _actor_init() -> None:
    """The actors' ``on_actor_init_fn``: ``preload`` with the default modules."""
    preload()


def with_preload(build: Callable[..., Any]) -> Callable[..., Any]:
    """``RayBackend.build`` that first gives the actors ``on_actor_init_fn`` (unless set)."""

    def build_with_preload(self: Any, app_fn: Callable[[], Any]) -> None:
        kwargs = dict(self.actor_kwargs or {})
        kwargs.setdefault("on_actor_init_fn", _actor_init)
        self.actor_kwargs = kwargs
        build(self, app_fn)

    build_with_preload.__wrapped__ = build  # type: ignore[attr-defined]
    return build_with_preload


def install() -> bool:
    """Make the simulation's Ray actors preload (in the simulation process, on known Flower
    sources); True when in place (now or before)."""
    if ENGINE_MODULE not in sys.modules or os.environ.get(ENV_SWITCH, "1") == "0":
        return False

    backend = importlib.import_module(BACKEND_MODULE).RayBackend
    if getattr(backend.build, "__wrapped__", None) is not None:
        return True
    actor = importlib.import_module(ACTOR_MODULE).ClientAppActor
    sources = {"RayBackend.build": backend.build, "ClientAppActor.__init__": actor.__init__}
    unknown = unknown_sources(sources, FLOWER_SOURCES)
    if unknown:
        print(
            f"fedfm_flower.simulation.actor_preload: Flower's {', '.join(unknown)} is not the "
            "code this project knows; the actors import on their first message",
            file=sys.stderr,
        )
        return False
    backend.build = with_preload(backend.build)
    log.debug("simulation actors: preloading %s", ", ".join(PRELOADED))
    return True
