"""Client halves of the baselines every paper compares against.

They differ only in which parameter groups are shared with the server and which stay on the
client, and in the local schedule:

* ``local``: adapter and head local, nothing sent;
* ``fedavg``: adapter and head shared;
* ``fedrep``: adapter shared, head local; ``head-epochs`` epochs on the head with the adapter
  fixed, then ``local-epochs`` on the adapter with the head fixed (Collins et al. 2021);
* ``fedavg-ft``: FedAvg, and before each evaluation a copy is fine-tuned for
  ``finetune-epochs`` on the client's train split (the papers' "+post-train" baseline).
"""

from __future__ import annotations

import torch

from client_apps.base import ClientLogic, ClientRuntime
from fedfm_flower.models import AdaptedClassifier
from fedfm_flower.training import EvalStats, TrainStats, evaluate, train


class SplitClient(ClientLogic):
    """Shared groups come from the server and go back; local groups live in client state."""

    shared: tuple[str, ...] = ("adapter", "head")
    local: tuple[str, ...] = ()

    def prepare(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], personal_round: dict
    ) -> AdaptedClassifier:
        """The model with local state (per ``personal_round`` lookup) and received tensors."""
        model = runtime.model()
        if self.local:
            personal = runtime.store.load(**personal_round)
            if personal is not None:
                model.load_tensors(personal)
        model.load_tensors(received)
        return model

    def local_training(
        self, runtime: ClientRuntime, model: AdaptedClassifier, server_round: int
    ) -> TrainStats:
        """Joint training of every shared and local group."""
        params = model.group_parameters(self.shared + self.local).values()
        return train(
            model,
            runtime.data.train,
            params,
            runtime.config,
            seed=runtime.seed(server_round),
            device=runtime.device,
        )

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Load, train, keep the local groups, send the shared ones."""
        model = self.prepare(runtime, received, {"before": server_round})
        stats = self.local_training(runtime, model, server_round)
        if self.local:
            runtime.store.save(server_round, model.group_tensors(self.local))
        return model.group_tensors(self.shared), stats

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Evaluate with the received shared groups and the latest local ones."""
        model = self.prepare(runtime, received, {"at_most": server_round})
        return evaluate(model, runtime.data.test, device=runtime.device)


class LocalClient(SplitClient):
    """Local adapter tuning: nothing leaves the client."""

    shared = ()
    local = ("adapter", "head")


class FedAvgClient(SplitClient):
    """Adapter and head both averaged by the server."""

    shared = ("adapter", "head")
    local = ()


class FedRepClient(SplitClient):
    """Adapter shared, head local, trained head-first as in FedRep."""

    shared = ("adapter",)
    local = ("head",)

    def local_training(
        self, runtime: ClientRuntime, model: AdaptedClassifier, server_round: int
    ) -> TrainStats:
        """Head epochs with the adapter fixed, then adapter epochs with the head fixed."""
        config = runtime.config
        head_stats = train(
            model,
            runtime.data.train,
            model.group_parameters(self.local).values(),
            config,
            seed=runtime.seed(server_round, salt=1),
            epochs=config.head_epochs,
            steps=0,
            device=runtime.device,
        )
        body_stats = train(
            model,
            runtime.data.train,
            model.group_parameters(self.shared).values(),
            config,
            seed=runtime.seed(server_round),
            device=runtime.device,
        )
        return TrainStats(
            body_stats.loss,
            body_stats.accuracy,
            body_stats.num_examples,
            head_stats.num_steps + body_stats.num_steps,
            head_stats.seconds + body_stats.seconds,
        )


class FedAvgFineTuneClient(FedAvgClient):
    """FedAvg; evaluation fine-tunes a copy of the global model on local data first."""

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Fine-tune adapter and head for finetune-epochs, then evaluate (nothing is kept)."""
        model = self.prepare(runtime, received, {"at_most": server_round})
        train(
            model,
            runtime.data.train,
            model.group_parameters(self.shared).values(),
            runtime.config,
            seed=runtime.seed(server_round, salt=2),
            epochs=runtime.config.finetune_epochs,
            steps=0,
            device=runtime.device,
        )
        return evaluate(model, runtime.data.test, device=runtime.device)


class FedVPTClient(SplitClient):
    """Visual prompts shared (averaged by the server), head local, trained jointly."""

    shared = ("prompt",)
    local = ("head",)
