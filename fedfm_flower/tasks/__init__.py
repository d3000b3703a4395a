"""The tasks: task name -> its ``Task`` instance, its class imported on demand from the task
table (``fedfm_flower.tasks.registry``).

A dataset names its task (``fedfm_flower.data.registry.DatasetSpec.task``), so the run config's
``dataset`` decides the task. This module stays light: the ClientApp imports it per message.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

from fedfm_flower.data.registry import dataset_spec
from fedfm_flower.tasks.registry import task_entry

if TYPE_CHECKING:
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.tasks.base import Task


@functools.cache
def get_task(name: str) -> Task:
    """The task registered as ``name`` (one instance per process)."""
    module, _, attr = task_entry(name).path.partition(":")
    return getattr(importlib.import_module(module), attr)()


def task_of(config: ExperimentConfig) -> Task:
    """The task of the configured dataset."""

    return get_task(dataset_spec(config.dataset).task)
