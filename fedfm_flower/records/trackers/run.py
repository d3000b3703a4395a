"""The run's trackers as one (``Trackers``), opened from the run config (``open_trackers``)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfm_flower.records.trackers.base import Tracker
from fedfm_flower.records.trackers.mlflow import MlflowLog
from fedfm_flower.records.trackers.tensorboard import TensorBoardLog
from fedfm_flower.records.trackers.wandb import WandbLog

if TYPE_CHECKING:
    from fedfm_flower.config.experiment import ExperimentConfig

log = logging.getLogger(__name__)


class Trackers:
    """The run's trackers as one: each call goes to every tracker still on."""

    def __init__(self, trackers: dict[str, Tracker]) -> None:
        self.trackers = trackers

    def _each(self, action: str, *args: Any) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                getattr(tracker, action)(*args)
            except Exception as error:  # noqa: BLE001 - a view must not stop the run
                log.warning(
                    "tracker %s failed (%s: %s); it is off now", name, type(error).__name__, error
                )
                self.trackers.pop(name)

    def log_round(self, record: dict[str, Any]) -> None:
        """Every tracker logs ``record``."""
        self._each("log_round", record)

    def log_summary(self, summary: dict[str, Any]) -> None:
        """Every tracker logs ``summary``."""
        self._each("log_summary", summary)

    def close(self, failed: bool = False) -> None:
        """Every tracker closes."""
        self._each("close", failed)


def require(package: str, key: str) -> None:
    """An ImportError naming the run-config key and the extra when ``package`` is missing."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(
            f"run config '{key}' = true needs the {package} package on the ServerApp's machine: "
            f"pip install -e '.[{key}]' (or pip install {package})"
        )


def open_trackers(config: ExperimentConfig, run_path: Path, run_name: str) -> Trackers:
    """The trackers ``config`` switches on, opened for the run in ``run_path``."""
    for key, package in (("wandb", "wandb"), ("mlflow", "mlflow")):
        if getattr(config, key):
            require(package, key)
    opened = Trackers({})
    try:
        if config.tensorboard:
            opened.trackers["tensorboard"] = TensorBoardLog(run_path)
        if config.wandb:
            opened.trackers["wandb"] = WandbLog(config, run_path, run_name)
        if config.mlflow:
            opened.trackers["mlflow"] = MlflowLog(config, run_path, run_name)
    except Exception:
        opened.close(failed=True)  # the ones that did open
        raise
    return opened
