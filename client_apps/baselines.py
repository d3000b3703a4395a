"""Client halves of the baselines every paper compares against.

They differ only in which parameter groups are shared with the server and which stay on the
client, and in the local schedule. ``shared``/``local`` are selections of groups (or name
patterns, ``fedfm_flower.models.groups.select_names``); ``None`` on one side means every
trainable parameter the other side does not select, so with a trainable backbone
(``train-backbone``) FedAvg and FedRep share the ViT's own weights too:

* ``local``: adapter and head local, nothing sent;
* ``fedavg``: adapter and head shared;
* ``fedrep``: adapter shared, head local; ``head-epochs`` epochs on the head with the adapter
  fixed, then ``local-epochs`` on the adapter with the head fixed (Collins et al. 2021);
* ``fedavg-ft``: FedAvg, and before each evaluation a copy is fine-tuned for
  ``finetune-steps`` steps or ``finetune-epochs`` epochs on the client's train split (the
  papers' "+ post-train" baseline: at the last round it is FedAvg, then local training);
* ``centralized``: one client trains the shared groups on every client's training data
  pooled, every client evaluates them (FedDPA's Centralized upper reference; a simulation
  device, since in a deployment no node holds the others' data).

Groups a model does not have select nothing: on a causal LM (no task head) ``fedavg`` shares
the adapter only.
"""

from __future__ import annotations

import torch

from client_apps.base import ClientLogic, ClientRuntime
from fedfm_flower.models import TunedModel
from fedfm_flower.models.groups import split_names
from fedfm_flower.training import EvalStats, TrainStats


class SplitClient(ClientLogic):
    """Shared groups come from the server and go back; local groups live in client state."""

    shared: tuple[str, ...] | None = None
    local: tuple[str, ...] | None = ()

    def split(self, runtime: ClientRuntime, model: TunedModel) -> tuple[list[str], list[str]]:
        """(shared, local) parameter names of ``model`` for this method, among the parts this
        client owns (all of them, unless the model's components serve only some holdings)."""
        owned = set(model.names_for(runtime.task.holdings(runtime.data)))
        groups = {n: g for n, g in model.parameter_groups().items() if n in owned}
        return split_names(groups, self.shared, self.local)

    def prepare(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], personal_round: dict
    ) -> TunedModel:
        """The model with local state (per ``personal_round`` lookup) and received tensors."""
        model = runtime.model()
        if self.split(runtime, model)[1]:
            personal = runtime.store.load(**personal_round)
            if personal is not None:
                model.load_tensors(personal)
        model.load_tensors(received)
        return model

    def local_training(
        self, runtime: ClientRuntime, model: TunedModel, server_round: int
    ) -> TrainStats:
        """Joint training of every shared and local group."""
        shared, local = self.split(runtime, model)
        return runtime.train(model, shared + local, runtime.seed(server_round))

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Load, train, keep the local groups, send the shared ones."""
        model = self.prepare(runtime, received, {"before": server_round})
        stats = self.local_training(runtime, model, server_round)
        shared, local = self.split(runtime, model)
        if local:
            runtime.store.save(server_round, model.tensors_named(local))
        return model.tensors_named(shared), stats

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Evaluate with the received shared groups and the latest local ones."""
        model = self.prepare(runtime, received, {"at_most": server_round})
        return runtime.evaluate(model)


class LocalClient(SplitClient):
    """Local adapter tuning: nothing leaves the client."""

    shared = ()
    local = None


class FedAvgClient(SplitClient):
    """Everything trainable (adapter and head) averaged by the server."""

    shared = None
    local = ()


class FedRepClient(SplitClient):
    """Adapter shared, head local, trained head-first as in FedRep."""

    shared = None
    local = ("head",)

    def local_training(
        self, runtime: ClientRuntime, model: TunedModel, server_round: int
    ) -> TrainStats:
        """Head epochs with the adapter fixed, then adapter epochs with the head fixed."""
        shared, local = self.split(runtime, model)
        head_stats = runtime.train(
            model,
            local,
            runtime.seed(server_round, salt=1),
            epochs=runtime.config.head_epochs,
            steps=0,
        )
        return head_stats.then(runtime.train(model, shared, runtime.seed(server_round)))


class FedAvgFineTuneClient(FedAvgClient):
    """FedAvg; evaluation fine-tunes a copy of the global model on local data first."""

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Fine-tune the shared groups (``ClientRuntime.fine_tune``), then evaluate (nothing is
        kept)."""
        model = self.prepare(runtime, received, {"at_most": server_round})
        runtime.fine_tune(model, self.split(runtime, model)[0], server_round)
        return runtime.evaluate(model)


class CentralizedClient(FedAvgClient):
    """The Centralized reference: the client the server picks trains on every client's data."""

    def local_training(
        self, runtime: ClientRuntime, model: TunedModel, server_round: int
    ) -> TrainStats:
        """Joint training of every trainable group on the pooled training data."""
        shared, local = self.split(runtime, model)
        return runtime.train(
            model, shared + local, runtime.seed(server_round), data=runtime.pooled_train
        )


class FedVPTClient(SplitClient):
    """Visual prompts shared (averaged by the server), head local, trained jointly."""

    shared = None
    local = ("head",)
