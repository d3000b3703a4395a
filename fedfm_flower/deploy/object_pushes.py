"""Objects the SuperLink did not store, pushed again: for the SuperNode and the ServerApp.

Flower's SuperLink (1.41, 1.42) catches an error of its object store (under load, its SQLite
state's ``database is locked``) and answers a push with ``stored = false``; Flower's push
function then raises ``ObjectPushError``, and the SuperNode gives up its reply, the ServerApp
its run (seen with 30 SuperNodes on 2 cores). Here such a push is tried again after
``FIRST_PAUSE_S``, doubling, up to ``RETRIES`` times; the SuperLink rolled the failed store
back, so a retry stores the object once. The node's Fleet connection and the ServerApp's grid
each make their push functions with Flower's ``make_push_object_fn_protobuf``, which is
wrapped in that module only, on the Flower versions ``known_flower`` names.

Imports inside functions keep ``flwr.supercore`` out of this module's start-up.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from fedfm_flower.deploy.known_flower import wrap_flower_factory

RETRIES = 5  # pushes tried again: 0.5, 1, 2, 4, 8 s apart
FIRST_PAUSE_S = 0.5
PUSH_FACTORY = "make_push_object_fn_protobuf"
FLEET_MODULE = "flwr.supernode.fleet_http_connection"  # the SuperNode's Fleet connection
GRID_MODULE = "flwr.superlink.grid.http_grid"  # a deployed ServerApp's grid


def retrying_unstored_pushes(make: Any, retries: int, first_pause: float) -> Any:
    """``make`` (Flower's push-object factory) whose push functions try an object the SuperLink
    did not store (``ObjectPushError``) again, up to ``retries`` times, pausing ``first_pause``
    seconds, doubling."""
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

    @functools.wraps(make)
    def make_push(*args: Any, **kwargs: Any) -> Any:
        push = make(*args, **kwargs)

        def push_object(object_id: str, content: bytes) -> None:
            pause = first_pause
            for attempt in range(retries + 1):
                try:
                    return push(object_id, content)
                except ObjectPushError:
                    if attempt == retries:
                        raise
                    time.sleep(pause)
                    pause *= 2

        return push_object

    make_push.retries_unstored = retries  # type: ignore[attr-defined]
    return make_push


def retry_object_pushes(
    module: str = FLEET_MODULE, retries: int = RETRIES, first_pause: float = FIRST_PAUSE_S
) -> bool:
    """Let the pushes made in Flower's ``module`` try an object the SuperLink did not store
    again (module doc); False, changing nothing, on a Flower this was not written against."""
    return wrap_flower_factory(
        module,
        PUSH_FACTORY,
        lambda make: retrying_unstored_pushes(make, retries, first_pause),
        "fedfm_flower.deploy.object_pushes",
        "an object the SuperLink did not store is not pushed again",
    )


def retry_grid_object_pushes(grid: object) -> bool:
    """``retry_object_pushes`` for the ServerApp's pushes when ``grid`` is a deployed one
    (Flower's HTTP grid); False, changing nothing, for any other grid (a simulation's)."""
    return type(grid).__module__ == GRID_MODULE and retry_object_pushes(GRID_MODULE)
