"""FedAvg over the shared parameter groups (adapter and head), weighted by example counts.

The global tensors are averaged in float64 and cast back, so the result does not depend on the
order replies arrive in. Subclasses choose which groups are shared (``shared_groups``).
"""

from __future__ import annotations

import torch

from fedfm_flower.aggregation import weighted_average
from fedfm_flower.config import ExperimentConfig
from fedfm_flower.models import parameter_group
from fedfm_flower.records import tensor_spec
from strategies.base import ClientReply, PersonalizedStrategy


class FedAvgStrategy(PersonalizedStrategy):
    """One global copy of the shared groups, averaged over the reporting clients."""

    shared_groups: tuple[str, ...] = ("adapter", "head")

    def __init__(self, config: ExperimentConfig, initial: dict[str, torch.Tensor]) -> None:
        super().__init__(config, initial)
        self.global_tensors = {
            k: v.clone() for k, v in initial.items() if parameter_group(k) in self.shared_groups
        }

    def train_payload(self, client_id: int, server_round: int) -> dict[str, torch.Tensor]:
        """The global shared tensors (the same for every client)."""
        return self.global_tensors

    def reply_spec(self, client_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Replies carry the shared tensors, shaped like the global ones."""
        return tensor_spec(self.global_tensors)

    def aggregate(self, server_round: int, replies: list[ClientReply]) -> None:
        """Example-weighted average of the replies (eq. 1 of pFedSeq, FedAvg)."""
        if not self.global_tensors:
            return
        weights = [float(r.num_examples) for r in replies]
        if sum(weights) == 0:
            weights = [1.0] * len(replies)
        self.global_tensors = weighted_average([r.arrays for r in replies], weights)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The global shared tensors."""
        return {f"global.{k}": v for k, v in self.global_tensors.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the global shared tensors."""
        expected = set(self.state_tensors())
        if set(tensors) != expected:
            raise ValueError("checkpoint tensors do not match this FedAvg configuration")
        self.global_tensors = {k[len("global.") :]: v.clone() for k, v in tensors.items()}
