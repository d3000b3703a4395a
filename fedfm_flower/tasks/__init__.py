"""The task registry: task name -> its ``Task`` class (imported on demand).

A dataset names its task (``fedfm_flower.data.registry.DatasetSpec.task``), so the run config's
``dataset`` decides the task. This module stays light: the ClientApp imports it per message.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedfm_flower.config import ExperimentConfig
    from fedfm_flower.tasks.base import Task


@dataclass(frozen=True)
class TaskEntry:
    """Where a task's class lives, the input modality its models take, and whether its client
    data holds a validation split (``val-fraction``) that ``evaluation-split = val`` reads."""

    path: str
    modality: str
    validation: bool = False


TASKS: dict[str, TaskEntry] = {
    "image-classification": TaskEntry(
        "fedfm_flower.tasks.classification:ImageClassification", "image", validation=True
    ),
    "instruction-following": TaskEntry(
        "fedfm_flower.tasks.instructions:InstructionFollowing", "text", validation=True
    ),
    "multimodal-multitask": TaskEntry(
        "fedfm_flower.tasks.multitask:MultimodalMultitask", "multimodal", validation=True
    ),
}


def task_modality(name: str) -> str:
    """The input modality of task ``name`` (no import of the task's module)."""
    return _entry(name).modality


def task_has_validation(name: str) -> bool:
    """Whether task ``name``'s client data holds a validation split (no import of the task)."""
    return _entry(name).validation


def _entry(name: str) -> TaskEntry:
    if name not in TASKS:
        raise ValueError(f"task '{name}' unknown; known: {', '.join(TASKS)}")
    return TASKS[name]


@functools.cache
def get_task(name: str) -> Task:
    """The task registered as ``name`` (one instance per process)."""
    module, _, attr = _entry(name).path.partition(":")
    return getattr(importlib.import_module(module), attr)()


def task_of(config: ExperimentConfig) -> Task:
    """The task of the configured dataset."""
    from fedfm_flower.data.registry import dataset_spec

    return get_task(dataset_spec(config.dataset).task)
