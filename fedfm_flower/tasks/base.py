"""What a task is: the part of a learning problem that the shared loops do not know.

A ``Task`` owns a client's data (loading and batching), the training loss, the evaluation and
its metrics (a dict, with one ``primary_metric`` that the progress line, the summary and the
benchmarks report), and the example counts the run checks at start. The training and
evaluation loops (``fedfm_flower.tasks.training``), the ClientApp, the strategies and the runner
only see tensors, losses and metric dicts; nothing above this layer mentions labels, argmax,
accuracy or ROUGE.

Imports inside functions keep ``torch`` out of this module's start-up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.data.sizes import ClientExamples

Batch = tuple["torch.Tensor", ...]


@dataclass(frozen=True)
class StepResult:
    """One training batch: the loss to back-propagate, its size and summed batch statistics."""

    loss: torch.Tensor
    count: int
    sums: dict[str, float] = field(default_factory=dict)  # e.g. {"accuracy": correct}


@dataclass(frozen=True)
class EvalStats:
    """Mean loss and the task's metrics of a model on a dataset."""

    loss: float
    metrics: dict[str, float]
    num_examples: int


@dataclass(frozen=True)
class TrainStats:
    """What one local training call did; ``metrics`` are the task's training statistics.

    ``examples_seen`` counts the examples the loop trained on (epochs x data, or steps x batch),
    not the client's data size: a reply's aggregation weight is ``ClientLogic.data_size``.
    """

    loss: float
    metrics: dict[str, float]
    examples_seen: int
    num_steps: int
    seconds: float

    def then(self, later: TrainStats) -> TrainStats:
        """Two training calls in a row: ``later``'s loss and metrics, summed examples seen,
        steps and seconds."""
        return TrainStats(
            later.loss,
            later.metrics,
            self.examples_seen + later.examples_seen,
            self.num_steps + later.num_steps,
            self.seconds + later.seconds,
        )


class Task(ABC):
    """A kind of learning problem: its data, loss, evaluation and metrics."""

    name: ClassVar[str]
    primary_metric: ClassVar[str]  # a key of EvalStats.metrics; higher is better
    modality: ClassVar[str]  # what the model's input is: "image", "text", ...

    @abstractmethod
    def client_data(self, config: ExperimentConfig, partition_id: int, num_partitions: int) -> Any:
        """One client's splits (``.train``, ``.test``), in the form ``batches`` reads."""

    @abstractmethod
    def example_counts(self, config: ExperimentConfig, num_clients: int) -> list[ClientExamples]:
        """Example counts of clients 0..num_clients-1, without preparing their data."""

    def num_outputs(self, config: ExperimentConfig, data: Any | None = None) -> int:
        """Width of the task head the model family adds (0: the backbone's own output)."""
        return 0

    @abstractmethod
    def batches(
        self, data: Any, batch_size: int, generator: torch.Generator | None
    ) -> Iterator[Batch]:
        """Batches of ``data`` in a seeded order (``generator``) or in order (None)."""

    @abstractmethod
    def step(self, model: nn.Module, batch: Batch) -> StepResult:
        """The training loss of ``model`` on one batch (already on the model's device)."""

    @abstractmethod
    def evaluate(
        self, model: nn.Module, data: Any, device: torch.device, batch_size: int
    ) -> EvalStats:
        """Loss and metrics of ``model`` on ``data`` (no gradients, model in eval mode)."""

    def holdings(self, data: Any) -> tuple[str, ...]:
        """What a client's ``data`` holds that decides which model components it owns (TAP's
        modality-task pairs); empty: it owns every trainable part."""
        return ()

    def client_holdings(
        self, config: ExperimentConfig, num_clients: int
    ) -> dict[str, tuple[str, ...]]:
        """{client id: its holdings} as the server derives them (empty: every part for all)."""
        return {}

    def client_labels(self, config: ExperimentConfig, num_clients: int) -> dict[str, str]:
        """{client id: what the client's data is} for reports (the run's ``client-tasks``);
        empty when the task has no such names."""
        return {}

    def client_domains(self, config: ExperimentConfig, num_clients: int) -> dict[str, str]:
        """{client id: the domain its data comes from} for reports (the run's
        ``client-domains``: pFedPG's Table 1 columns); empty when clients hold no one domain."""
        return {}

    def pooled_train(self, config: ExperimentConfig, num_partitions: int) -> Any:
        """Every client's training rows in one dataset (the Centralized reference): the
        clients' ``.train`` TensorDatasets concatenated row-wise, in client order."""
        import torch
        from torch.utils.data import TensorDataset

        parts = [self.client_data(config, p, num_partitions).train for p in range(num_partitions)]
        return TensorDataset(
            *(torch.cat(ts) for ts in zip(*(d.tensors for d in parts), strict=True))
        )

    def format_metric(self, name: str, value: float) -> str:
        """How the progress line prints a metric of this task."""
        return f"{value:.4f}"


class TrainingObjective(Task):
    """``task`` with another training loss: data, batches and evaluation are ``task``'s; a
    subclass defines ``step`` (TAP's distillation, FedDAT's mutual distillation)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.name = task.name
        self.primary_metric = task.primary_metric
        self.modality = task.modality

    def client_data(self, config: ExperimentConfig, partition_id: int, num_partitions: int) -> Any:
        """The wrapped task's client data."""
        return self.task.client_data(config, partition_id, num_partitions)

    def example_counts(self, config: ExperimentConfig, num_clients: int) -> list[ClientExamples]:
        """The wrapped task's counts."""
        return self.task.example_counts(config, num_clients)

    def batches(
        self, data: Any, batch_size: int, generator: torch.Generator | None
    ) -> Iterator[Batch]:
        """The wrapped task's batches."""
        return self.task.batches(data, batch_size, generator)

    def evaluate(
        self, model: nn.Module, data: Any, device: torch.device, batch_size: int
    ) -> EvalStats:
        """The wrapped task's evaluation."""
        return self.task.evaluate(model, data, device, batch_size)
