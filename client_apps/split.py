"""The client of the methods whose clients train what they share and what they keep jointly.

What a client sends and what it keeps is its method's split (``MethodSpec.split`` in
``fedfm_flower/methods/<method>.py``, resolved once per run config: ``ClientRuntime.method``, as
the strategy reads it; the names computed once per message: ``ClientRuntime.split``), among the
parts this client owns (all of them, unless the model's components
serve only some holdings: TAP's modality-task pairs). Shared groups come from the server and go
back; local groups live in client state. ``local``, ``fedavg``, ``fedvpt``, ``fedvpt-deep`` and
``fedperfix`` use ``SplitClient`` as it is; other methods subclass it for their schedule
(``client_apps.fedrep``, ``client_apps.fedavg_ft``, ``client_apps.centralized``,
``client_apps.fedprox``: its ``training_options``, ...) or what they send
(``client_apps.updates``).

Groups a model does not have select nothing: on a causal LM (no task head) ``fedavg`` shares
the adapter only. With a trainable backbone (``train-backbone``) "the rest" includes the ViT's
own weights.
"""

from __future__ import annotations

from typing import Any

import torch

from client_apps.base import ClientLogic, ClientRuntime
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.training import EvalStats, TrainStats


class SplitClient(ClientLogic):
    """Shared groups from the server and back; local groups in client state."""

    def split(self, runtime: ClientRuntime, model: TunedModel) -> tuple[list[str], list[str]]:
        """(shared, local) parameter names of ``model`` for this method, among the parts this
        client owns (``runtime.split``: once per message)."""
        return runtime.split(model)

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
        self,
        runtime: ClientRuntime,
        model: TunedModel,
        received: dict[str, torch.Tensor],
        server_round: int,
    ) -> TrainStats:
        """Joint training of every shared and local group, from the model holding ``received``,
        with ``training_options``."""
        shared, local = self.split(runtime, model)
        options = self.training_options(runtime, model, shared, received)
        return runtime.train(model, shared + local, runtime.seed(server_round), **options)

    def training_options(
        self,
        runtime: ClientRuntime,
        model: TunedModel,
        shared: list[str],
        received: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        """Further ``runtime.train`` arguments of the joint training (none: FedAvg's); a method
        that trains on other data (``centralized``) or adds to the loss what depends on the
        received tensors (FedProx's ``penalty``) returns them."""
        return {}

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Load, train, keep the local groups, send the shared ones."""
        model = self.prepare(runtime, received, {"before": server_round})
        stats = self.local_training(runtime, model, received, server_round)
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
