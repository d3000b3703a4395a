"""The task table: task name -> where its ``Task`` class lives, its input modality and whether
its client data holds a validation split. A leaf: the config reads it to check a run, and the
``Task`` classes, which take the config, live above the config.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    return task_entry(name).modality


def task_has_validation(name: str) -> bool:
    """Whether task ``name``'s client data holds a validation split (no import of the task)."""
    return task_entry(name).validation


def task_entry(name: str) -> TaskEntry:
    """The table's entry of task ``name``; ValueError naming the known tasks."""
    if name not in TASKS:
        raise ValueError(f"task '{name}' unknown; known: {', '.join(TASKS)}")
    return TASKS[name]
