"""How many examples each client holds, and the smallest partition a run accepts.

A skewed partition can leave a client with one training and one test example; its accuracy is
then 0 or 1 and, in the unweighted mean over clients, counts as much as a client with hundreds.
``check_client_sizes`` fails a run at start when any client holds fewer than
``min-train-examples`` training or ``min-test-examples`` test examples, naming the clients, their
counts and the settings that would change them. Partitions are never redrawn behind the user's
back: a redraw conditions the partition on its sizes, which is a different experiment.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data.federated import client_sample_ids


@dataclass(frozen=True)
class ClientExamples:
    """Example counts of one client's splits."""

    train: int
    test: int
    val: int

    def as_dict(self) -> dict[str, int]:
        """{"train": n, "test": n, "val": n}."""
        return {"train": self.train, "test": self.test, "val": self.val}


class PartitionTooSmallError(ValueError):
    """Some client holds fewer examples than the run config's minimum."""


def client_example_counts(config: ExperimentConfig, num_clients: int) -> list[ClientExamples]:
    """Example counts of clients 0..num_clients-1 (partition id = client id)."""
    counts = []
    for client in range(num_clients):
        ids = client_sample_ids(config, client, num_clients)
        counts.append(ClientExamples(len(ids.train), len(ids.test), len(ids.val)))
    return counts


def check_client_sizes(
    config: ExperimentConfig, counts: list[ClientExamples]
) -> list[ClientExamples]:
    """``counts`` (client id = position); ``PartitionTooSmallError`` when one is below the
    minimum."""
    num_clients = len(counts)
    small = [
        (client, c)
        for client, c in enumerate(counts)
        if c.train < config.min_train_examples or c.test < config.min_test_examples
    ]
    if not small:
        return counts
    client, worst = min(small, key=lambda item: (item[1].train, item[1].test))
    others = f" ({len(small)} clients are below it: {', '.join(str(c) for c, _ in small)})"
    raise PartitionTooSmallError(
        f"client {client} of {num_clients} holds {worst.train} training and {worst.test} test "
        f"examples, fewer than min-train-examples = {config.min_train_examples} / "
        f"min-test-examples = {config.min_test_examples}"
        f"{others if len(small) > 1 else ''}; {_remedies(config, worst)}"
    )


def _remedies(config: ExperimentConfig, worst: ClientExamples) -> str:
    """The settings that would give the smallest client more examples."""
    knobs = ["use fewer clients"]
    if config.partitioner == "dirichlet":
        knobs.append(f"raise dirichlet-alpha (now {config.dirichlet_alpha:g})")
    elif config.partitioner in ("pathological", "disjoint"):
        knobs.append(f"raise classes-per-client (now {config.classes_per_client})")
    if worst.test < config.min_test_examples <= worst.train:
        knobs.append(f"raise test-fraction (now {config.test_fraction:g})")
    knobs.append("or lower min-train-examples / min-test-examples")
    return ", ".join(knobs)
