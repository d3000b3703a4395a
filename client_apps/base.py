"""What every method's client logic shares: the runtime of one message and the base class.

A ``ClientRuntime`` is built per message from Flower's ``Context``: the validated config and its
method resolved (both once per run config in the process), the node's stable identity, its data
(prepared once per process), the cached model, the split of its parameters (once per message)
and the personal-state store. ``ClientLogic`` subclasses implement ``train`` and ``evaluate`` on
tensors; the ClientApp wraps them into Flower messages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from flwr.app import Context

from fedfm_flower.config.experiment import ExperimentConfig, NodeIdentity
from fedfm_flower.data.sealed import SealedSplit
from fedfm_flower.methods.registry import ResolvedMethod, resolve
from fedfm_flower.models import MODEL_CACHE, TunedModel, pick_device
from fedfm_flower.records.client_state import ClientStateStore
from fedfm_flower.tasks import task_of, training
from fedfm_flower.tasks.base import Task
from fedfm_flower.tasks.training import EvalStats, TrainStats, round_seed


@dataclass
class ClientRuntime:
    """Everything a client method needs to handle one message.

    ``method`` is ``config``'s method resolved (``fedfm_flower.methods.registry.resolve``).
    """

    config: ExperimentConfig
    identity: NodeIdentity
    store: ClientStateStore
    device: torch.device
    method: ResolvedMethod
    # model -> (model, its split): kept with the model, so an id is never reused within it
    _splits: dict[int, tuple[TunedModel, tuple[list[str], list[str]]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def from_context(cls, context: Context, run_name: str) -> ClientRuntime:
        """Parse config and node identity from Flower's context."""
        config, method = resolved_run_config(context.run_config)
        identity = NodeIdentity.from_node_config(context.node_config, config)
        store = ClientStateStore(
            context.state,
            identity.client_id,
            run_name,
            identity.state_dir,
            keep=config.keep_checkpoints + 1,  # see fedfm_flower.records.client_state
        )
        return cls(config, identity, store, pick_device(config.device), method)

    @functools.cached_property
    def task(self) -> Task:
        """The task of the configured dataset."""
        return task_of(self.config)

    @functools.cached_property
    def data(self):  # noqa: ANN201 - the task's client data, imported lazily
        """This client's train/test (and validation) split, as the task prepares it; with
        ``evaluation-split = val`` its test split is sealed (``fedfm_flower.data.sealed``)."""
        data = self.task.client_data(
            self.config, self.identity.partition_id, self.identity.num_partitions
        )
        if self.config.evaluation_split == "val":
            data = dataclasses.replace(data, test=SealedSplit("test", "evaluation-split = val"))
        return data

    @functools.cached_property
    def pooled_train(self):  # noqa: ANN201 - the task's data, imported lazily
        """Every client's training data in one place (the Centralized reference only)."""
        return self.task.pooled_train(self.config, self.identity.num_partitions)

    def model(self) -> TunedModel:
        """The (cached) model with its trainable parts at their seeded initial values."""
        outputs = self.task.num_outputs(self.config, self.data)
        return MODEL_CACHE.get(
            self.config,
            self.method.tuner,
            outputs,
            self.device,
            train_backbone=self.method.trains_backbone,
        )

    def split(self, model: TunedModel) -> tuple[list[str], list[str]]:
        """(shared, local) parameter names of ``model`` for this method, among the parts this
        client owns: computed once per message and model (fresh lists each call)."""
        known = self._splits.get(id(model))
        if known is None or known[0] is not model:
            owned = set(model.names_for(self.task.holdings(self.data)))
            groups = {n: g for n, g in model.parameter_groups().items() if n in owned}
            known = (model, self.method.split_names(groups))
            self._splits[id(model)] = known
        shared, local = known[1]
        return list(shared), list(local)

    def train(
        self,
        model: TunedModel,
        names: Iterable[str],
        seed: int,
        *,
        epochs: int | None = None,
        steps: int | None = None,
        penalty: Callable[[], torch.Tensor] | None = None,
        data: Any = None,
        task: Task | None = None,
    ) -> TrainStats:
        """Train the parameters called ``names`` of ``model`` on this client's train split (or
        ``data``) with the task's loss, or ``task``'s (``epochs``/``steps`` default to the
        config's local schedule; ``penalty`` is added to every batch's loss)."""

        params = model.parameters_named(names).values()
        return training.train(  # by module: benchmarks and tests time and spy on it
            task or self.task,
            model,
            self.data.train if data is None else data,
            params,
            self.config,
            seed=seed,
            epochs=epochs,
            steps=steps,
            device=self.device,
            penalty=penalty,
        )

    def fine_tune(self, model: TunedModel, names: Iterable[str], server_round: int) -> TrainStats:
        """Train ``names`` for the fine-tuning schedule (``finetune-steps`` steps when > 0, else
        ``finetune-epochs`` epochs) before an evaluation: the papers' "+ post-train"."""
        config = self.config
        return self.train(
            model,
            names,
            self.seed(server_round, salt=2),
            epochs=config.finetune_epochs,
            steps=config.finetune_steps,
        )

    def evaluate(self, model: TunedModel) -> EvalStats:
        """The task's loss and metrics of ``model`` on this client's evaluation split (test,
        or validation with ``evaluation-split = val``)."""

        split = self.data.val if self.config.evaluation_split == "val" else self.data.test
        return training.evaluate(self.task, model, split, device=self.device)

    def seed(self, server_round: int, salt: int = 0) -> int:
        """The seed of this client's work in ``server_round``."""
        return round_seed(self.config.seed, self.identity.client_id, server_round, salt)


def parsed_run_config(run_config: Mapping[str, Any]) -> ExperimentConfig:
    """``ExperimentConfig.from_run_config``, parsed once per content in this process."""
    return resolved_run_config(run_config)[0]


def resolved_run_config(run_config: Mapping[str, Any]) -> tuple[ExperimentConfig, ResolvedMethod]:
    """The parsed config and its resolved method, both once per content in this process.

    A run's config is the same for every message, but a simulation actor receives it as a
    fresh (unpickled) mapping each time, so it is cached by content: the keys, the values and
    the values' types (``True``, ``1`` and ``1.0`` are equal in Python but parse differently).
    A config that fails to parse is not cached, so it fails on every message as before.
    """
    try:
        key = tuple((name, type(value), value) for name, value in run_config.items())
        hash(key)
    except TypeError:  # an unhashable value: nothing to key on
        return _resolved(ExperimentConfig.from_run_config(run_config))
    return _resolved_run_config(key)


def _resolved(config: ExperimentConfig) -> tuple[ExperimentConfig, ResolvedMethod]:
    return config, resolve(config)


@functools.lru_cache(maxsize=8)
def _resolved_run_config(
    items: tuple[tuple[str, type, Any], ...],
) -> tuple[ExperimentConfig, ResolvedMethod]:
    return _resolved(ExperimentConfig.from_run_config({name: value for name, _, value in items}))


class ClientLogic:
    """One method's client half: tensors in, tensors and statistics out."""

    # Whether ``train`` returns updates (trained - received) rather than the trained tensors.
    sends_updates: ClassVar[bool] = False

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Train locally from ``received``; return what to send back and the statistics."""
        raise NotImplementedError

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Evaluate the personalized model on this client's test split.

        With ``fused-evaluation`` it runs right before ``train`` of the next round in the same
        message, on the same ``received``; it must look client state up with
        ``at_most=server_round``, seed with ``server_round`` and leave nothing that ``train``
        reads (no saved state, no change to ``received``; the cached model is reset by
        ``runtime.model()``), as every method here does.
        """
        raise NotImplementedError

    def data_size(self, runtime: ClientRuntime) -> int:
        """The weight of this client's training replies: its training-set size |D_i| (eq. 1
        of FedAvg), whatever the local schedule (``local-steps`` sees steps x batch examples on
        every client, ``TrainStats.examples_seen``)."""
        return len(runtime.data.train)

    def post_train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """A post-training round's work (after the last federated round), for methods that
        have such a phase (their strategy's ``post_training_rounds`` > 0)."""
        raise NotImplementedError(f"{type(self).__name__} has no post-training phase")
