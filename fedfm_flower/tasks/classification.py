"""Image classification: cross-entropy on class logits, accuracy as the primary metric.

Data are ``fedfm_flower.data.ClientData``: images ``[N, 3, H, W]`` and int64 labels in
``TensorDataset``s. The model maps a batch of images to class logits; the family adds a linear
head of ``num_outputs`` classes.

Imports inside functions keep ``torch`` out of this module's start-up.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fedfm_flower.data import (
    client_domains,
    client_example_counts,
    load_client_data,
    num_classes_of,
)
from fedfm_flower.tasks.base import Batch, EvalStats, StepResult, Task

if TYPE_CHECKING:  # torch loads in the methods: the launcher's partition checks need none
    import torch
    from torch import nn

    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.data.sizes import ClientExamples


def tensor_batches(
    data: torch.utils.data.TensorDataset, batch_size: int, generator: torch.Generator | None
) -> Iterator[Batch]:
    """Row batches of every tensor of ``data``, in a seeded permutation or in order."""
    import torch

    tensors = data.tensors
    n = len(tensors[0])
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    for start in range(0, n, batch_size):
        index = order[start : start + batch_size]
        yield tuple(t[index] for t in tensors)


class ImageClassification(Task):
    """Classify images; metrics: accuracy (primary)."""

    name = "image-classification"
    primary_metric = "accuracy"
    modality = "image"

    def client_data(self, config: ExperimentConfig, partition_id: int, num_partitions: int) -> Any:
        """The client's image/label splits (``fedfm_flower.data.load_client_data``)."""

        return load_client_data(config, partition_id, num_partitions)

    def example_counts(self, config: ExperimentConfig, num_clients: int) -> list[ClientExamples]:
        """Split sizes of every client from the partition plan (no pixels decoded)."""

        return client_example_counts(config, num_clients)

    def client_domains(self, config: ExperimentConfig, num_clients: int) -> dict[str, str]:
        """Each client's domain (``fedfm_flower.data.client_domains``: partition id = client
        id, as in ``example_counts``)."""

        return client_domains(config, num_clients)

    def num_outputs(self, config: ExperimentConfig, data: Any | None = None) -> int:
        """The number of classes (of the loaded data when given, else of the dataset)."""
        if data is not None:
            return data.num_classes

        return num_classes_of(config)

    def batches(
        self, data: Any, batch_size: int, generator: torch.Generator | None
    ) -> Iterator[Batch]:
        """(images, labels) batches."""
        return tensor_batches(data, batch_size, generator)

    def step(self, model: nn.Module, batch: Batch) -> StepResult:
        """Mean cross-entropy of the batch; the number of correct predictions as a sum."""
        from torch.nn.functional import cross_entropy

        images, labels = batch
        logits = model(images)
        loss = cross_entropy(logits, labels)
        correct = (logits.argmax(1) == labels).sum().item()
        return StepResult(loss, len(labels), {"accuracy": correct})

    def evaluate(
        self, model: nn.Module, data: Any, device: torch.device, batch_size: int
    ) -> EvalStats:
        """Mean cross-entropy and accuracy over ``data``."""
        import torch
        from torch.nn.functional import cross_entropy

        model.eval()
        total_loss, correct, seen = 0.0, 0, 0
        with torch.no_grad():
            for images, labels in tensor_batches(data, batch_size, None):
                images, labels = images.to(device), labels.to(device)
                logits = model(images)
                total_loss += cross_entropy(logits, labels, reduction="sum").item()
                correct += (logits.argmax(1) == labels).sum().item()
                seen += len(labels)
        return EvalStats(total_loss / max(seen, 1), {"accuracy": correct / max(seen, 1)}, seen)
