"""FedRoD's client (Chen & Chao 2022): a generic head trained with the balanced softmax, a
personal head on top of it (the rule and its choices: ``fedfm_flower.methods.fedrod``).

The body and the generic head ``h_G`` (the model's ``head``) come from the server and go back;
the personal head ``h_P``, a linear layer of ``h_G``'s shape, lives in the client state (two
tensors, ``fedrod-personal-weight`` and ``fedrod-personal-bias``). Per batch, one forward gives
the features ``z`` (the input of ``h_G``, caught by a forward hook) and ``h_G(z)``; the step
back-propagates the balanced softmax of ``h_G(z)`` into the body and ``h_G`` and the
cross-entropy of ``sg[h_G(z)] + h_P(sg[z])`` into ``h_P``, with the run's optimizer over all of
them. The reported training loss is the sum of the two, the training accuracy that of the
personalized prediction. Evaluation predicts ``h_G(z) + h_P(z)`` (the task's loss and
``accuracy``) and counts ``argmax h_G(z)`` in the same pass (``generic-accuracy``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn.functional import cross_entropy, linear

from client_apps.base import ClientLogic, ClientRuntime
from fedfm_flower.methods.fedrod import FedRoDSettings
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.base import Batch, StepResult, Task, TrainingObjective
from fedfm_flower.tasks.training import EvalStats, TrainStats, train

# h_P's keys in the client state (no model parameter's name lacks a dot).
PERSONAL_WEIGHT = "fedrod-personal-weight"
PERSONAL_BIAS = "fedrod-personal-bias"


def class_counts(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """How many of ``labels`` fall in each of ``num_classes`` classes (the client's prior n)."""
    counts = torch.bincount(labels.reshape(-1).long(), minlength=num_classes)
    if counts.numel() != num_classes:
        raise ValueError(f"a label is outside the {num_classes} classes of the head")
    return counts


def balanced_softmax_loss(
    logits: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy of ``logits + log counts`` (Balanced Softmax, Ren et al. 2020): a
    class with count 0 gets ``-inf``, out of the softmax's normaliser and of the gradient."""
    return cross_entropy(logits + counts.to(logits).log(), labels)


def generic_head(model: nn.Module) -> nn.Linear:
    """``model``'s classification head ``head``, a linear layer with a bias (h_G)."""
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear) or head.bias is None:
        raise TypeError(
            f"method 'fedrod' needs a model with a linear classification head 'head'; "
            f"{type(model).__name__} has none"
        )
    return head


def features_and_logits(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(z, h_G(z)): the input and the output of ``model``'s head on ``images``, one forward."""
    caught: list[tuple[torch.Tensor, torch.Tensor]] = []
    handle = generic_head(model).register_forward_hook(
        lambda _module, inputs, output: caught.append((inputs[0], output))
    )
    try:
        model(images)
    finally:
        handle.remove()
    if len(caught) != 1:
        raise RuntimeError(f"the head ran {len(caught)} times in one forward; FedRoD needs once")
    return caught[0]


class PersonalHead(nn.Module):
    """h_P: a linear layer of the generic head's shape, kept by its client."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Its logits."""
        return linear(features, self.weight, self.bias)

    def state(self) -> dict[str, torch.Tensor]:
        """Its tensors under their client-state keys."""
        return {PERSONAL_WEIGHT: self.weight.detach(), PERSONAL_BIAS: self.bias.detach()}


class FedRoDObjective(TrainingObjective):
    """The image task with FedRoD's two losses: BSM on h_G(z), CE on sg[h_G(z)] + h_P(sg[z])."""

    def __init__(self, task: Task, personal: PersonalHead, counts: torch.Tensor) -> None:
        super().__init__(task)
        self.personal = personal
        self.counts = counts

    def step(self, model: nn.Module, batch: Batch) -> StepResult:
        """Both losses from one forward; the personal one reaches h_P only."""
        images, labels = batch
        features, generic = features_and_logits(model, images)
        generic_loss = balanced_softmax_loss(generic, labels, self.counts)
        personalized = generic.detach() + self.personal(features.detach())
        personal_loss = cross_entropy(personalized, labels)
        correct = (personalized.argmax(1) == labels).sum().item()
        return StepResult(generic_loss + personal_loss, len(labels), {"accuracy": correct})


class PersonalizedClassifier(nn.Module):
    """``model`` predicting h_G(z) + h_P(z); it keeps argmax h_G(z) of every batch, in order."""

    def __init__(self, model: nn.Module, personal: PersonalHead) -> None:
        super().__init__()
        self.model = model
        self.personal = personal
        self.generic_predictions: list[torch.Tensor] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The personalized logits."""
        features, generic = features_and_logits(self.model, images)
        self.generic_predictions.append(generic.argmax(1))
        return generic + self.personal(features)


class FedRoDClient(ClientLogic):
    """Body and generic head from the server and back; the personal head in client state."""

    def personal(
        self, runtime: ClientRuntime, model: TunedModel, lookup: Mapping[str, int]
    ) -> PersonalHead:
        """h_P saved per ``lookup``; else its first value (``fedrod-personal-init``) from
        ``model``, which must still hold its initial values."""
        head = generic_head(model)
        state = runtime.store.load(**lookup)
        if state is not None:
            weight, bias = state[PERSONAL_WEIGHT], state[PERSONAL_BIAS]
        elif runtime.config.settings_of(FedRoDSettings).personal_init == "zeros":
            weight, bias = torch.zeros_like(head.weight), torch.zeros_like(head.bias)
        else:
            weight, bias = head.weight, head.bias
        return PersonalHead(weight.to(head.weight), bias.to(head.bias))

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Both losses on the local schedule; keep h_P, send the body and h_G."""
        model = runtime.model()  # at its initial values: h_P's start when no state is saved
        personal = self.personal(runtime, model, {"before": server_round})
        model.load_tensors(received)
        shared, _ = runtime.split(model)
        train_split = runtime.data.train
        counts = class_counts(train_split.tensors[1], generic_head(model).out_features)
        objective = FedRoDObjective(runtime.task, personal, counts.to(runtime.device))
        stats = train(
            objective,
            model,
            train_split,
            [*model.parameters_named(shared).values(), *personal.parameters()],
            runtime.config,
            seed=runtime.seed(server_round),
            device=runtime.device,
        )
        runtime.store.save(server_round, personal.state())
        return model.tensors_named(shared), stats

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """h_G + h_P with the received body and h_G and the latest h_P (the task's metrics),
        and the accuracy of h_G alone (``generic-accuracy``)."""
        model = runtime.model()
        personal = self.personal(runtime, model, {"at_most": server_round})
        model.load_tensors(received)
        predictor = PersonalizedClassifier(model, personal)
        stats = runtime.evaluate(predictor)
        split = runtime.data.val if runtime.config.evaluation_split == "val" else runtime.data.test
        labels = split.tensors[1]
        # The task evaluates its split in order (no shuffling), one forward per batch.
        predicted = torch.cat(predictor.generic_predictions) if len(labels) else labels
        if len(predicted) != len(labels):
            raise RuntimeError("the evaluation did not predict every example once, in order")
        generic = (predicted.cpu() == labels).sum().item() / max(len(labels), 1)
        metrics = {**stats.metrics, "generic-accuracy": generic}
        return EvalStats(stats.loss, metrics, stats.num_examples)
