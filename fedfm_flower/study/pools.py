"""Where a sweep's cells run: one after another in this process, or as Ray tasks in parallel.

A pool takes cells (``submit``) and hands back each finished cell with its record
(``next_done``), in the order they finish. Both pools run the same function,
``fedfm_flower.study.cells.cell_record``, so a cell's results do not depend on where it ran.

``RayPool`` makes each cell a Ray task with declared resources (``num_cpus``, ``num_gpus``,
fractions allowed), on a Ray instance it starts on this machine or on an existing cluster
(``address``: ``auto``, ``<host>:<port>`` or ``ray://<host>:10001``). Every node of a cluster
must import this package (the same commit) and see the sweep directory at the same path (a
shared file system): a cell writes its run there. A task whose worker dies is retried
(``max_retries``); the retry resumes the run from its newest checkpoint, as a rerun of the
sweep does. A Ray worker has its raylet's environment, not the driver's: the driver's
settings that change how a cell runs (``CELL_SETTINGS``) go with each task, so a cell on Ray runs
as it would in the serial sweep.

Imports inside functions keep ``ray`` out of this module's start-up.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fedfm_flower.records.logs import configure_logging
from fedfm_flower.study.cells import cell_record, failed_record

if TYPE_CHECKING:
    from fedfm_flower.study.cells import Cell

# How long RayPool.next_done waits in one call to Ray: signal handlers run between calls.
WAIT_SLICE_S = 1.0
# Environment variables a cell reads (named where they are read; tests/test_pools.py checks).
CELL_SETTINGS = (
    "FEDFM_SIMULATION_ENGINE",  # fork_engine.ENV_SWITCH
    "FEDFM_PROMPT_ENGINE",  # prompt_engine.ENV_SWITCH
    "FEDFM_ACTOR_PRELOAD",  # actor_preload.ENV_SWITCH
    "FEDFM_INJECT_FAULT",  # client_apps.faults.ENVIRONMENT_VARIABLE
)


class CellPool(Protocol):
    """Runs cells; ``next_done`` returns the next finished one with its record."""

    def capacity(self) -> int:
        """How many cells may usefully be in flight at once."""

    def submit(self, cell: Cell) -> None:
        """Queue ``cell`` to run."""

    def pending(self) -> int:
        """Cells submitted and not yet returned by ``next_done``."""

    def next_done(self) -> tuple[Cell, dict[str, Any]]:
        """Block until a submitted cell has finished; that cell and its record."""

    def close(self) -> None:
        """Release what the pool holds (a Ray instance it started)."""


class SerialPool:
    """Cells one after another in this process, in the order submitted."""

    def __init__(self) -> None:
        self._queue: deque[Cell] = deque()

    def capacity(self) -> int:
        """One at a time."""
        return 1

    def submit(self, cell: Cell) -> None:
        """Queue ``cell``."""
        self._queue.append(cell)

    def pending(self) -> int:
        """Queued cells."""
        return len(self._queue)

    def next_done(self) -> tuple[Cell, dict[str, Any]]:
        """Run the oldest queued cell now."""

        cell = self._queue.popleft()
        return cell, cell_record(cell)

    def close(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True)
class RayResources:
    """What each cell asks of Ray."""

    cpus: float = 1.0
    gpus: float = 0.0
    max_retries: int = 3  # re-executions after the worker process died

    def __post_init__(self) -> None:
        if not self.cpus > 0:
            raise ValueError(f"cpus per cell must be > 0, got {self.cpus}")
        if self.gpus < 0:
            raise ValueError(f"gpus per cell must be >= 0, got {self.gpus}")
        if self.max_retries < 0:
            raise ValueError(f"max retries must be >= 0, got {self.max_retries}")


def _ray_cell(cell: Cell) -> dict[str, Any]:
    """A cell's record, computed in a Ray worker, with the id of the node it ran on."""
    import ray

    configure_logging()
    return {**cell_record(cell), "node": ray.get_runtime_context().get_node_id()}


def _restore_sigterm_handler(handler: Any) -> None:
    """Put back a Python SIGTERM handler (``processes.exit_on_sigterm``) that ``ray.init``
    displaced: Ray's C++ failure handler would abort the process on SIGTERM, leaving the Ray
    instance running instead of letting ``close`` shut it down."""
    if callable(handler) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def cell_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The ``CELL_SETTINGS`` set in ``environ``, by name."""
    return {name: environ[name] for name in CELL_SETTINGS if name in environ}


class RayPool:
    """Cells as Ray tasks, run in parallel as the cluster's resources allow."""

    def __init__(self, resources: RayResources, address: str | None = None) -> None:
        import ray

        self.resources = resources
        self._started = not ray.is_initialized()
        if self._started:
            options: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
            if address:
                options["address"] = address
            else:  # "local": a new instance even where `ray start` left one to auto-join
                options["address"] = "local"
                options["num_cpus"] = os.cpu_count() or 1
            sigterm = signal.getsignal(signal.SIGTERM)
            ray.init(**options)
            _restore_sigterm_handler(sigterm)
        task: dict[str, Any] = {
            "num_cpus": resources.cpus,
            "num_gpus": resources.gpus,
            "max_retries": resources.max_retries,
        }
        if settings := cell_environment():
            task["runtime_env"] = {"env_vars": settings}
        self._task = ray.remote(_ray_cell).options(**task)
        self._flight: dict[Any, Cell] = {}

    def capacity(self) -> int:
        """Cells that fit the cluster's CPUs (and GPUs, when cells ask for them) at once."""
        import ray

        total = ray.cluster_resources()
        fits = int(total.get("CPU", 1) // self.resources.cpus)
        if self.resources.gpus > 0:
            fits = min(fits, int(total.get("GPU", 0) // self.resources.gpus))
        return max(1, fits)

    def submit(self, cell: Cell) -> None:
        """Start ``cell`` as a Ray task (Ray queues it until resources are free)."""
        self._flight[self._task.remote(cell)] = cell

    def pending(self) -> int:
        """Tasks not yet returned."""
        return len(self._flight)

    def next_done(self) -> tuple[Cell, dict[str, Any]]:
        """The first task to finish; a task that Ray gave up on becomes a failed record."""
        import ray

        ready: list[Any] = []
        while not ready:  # in 1 s slices: Python's Ctrl-C and SIGTERM handlers run between them
            ready, _ = ray.wait(list(self._flight), num_returns=1, timeout=WAIT_SLICE_S)
        (ref,) = ready
        cell = self._flight.pop(ref)
        try:
            return cell, ray.get(ref)
        except ray.exceptions.RayError as err:  # the worker died more often than max_retries
            return cell, failed_record(cell, f"Ray task lost: {err}")

    def close(self) -> None:
        """Shut down the Ray instance this pool started (a cluster it joined stays up)."""
        import ray

        if self._started and ray.is_initialized():
            ray.shutdown()


def make_pool(ray: bool, address: str = "", cpus: float = 1.0, gpus: float = 0.0) -> CellPool:
    """A ``RayPool`` when ``ray`` or ``address`` is given, else a ``SerialPool``."""
    if ray or address:
        return RayPool(RayResources(cpus=cpus, gpus=gpus), address or None)
    return SerialPool()
