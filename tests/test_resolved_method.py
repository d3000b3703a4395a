"""A run's method is resolved once (``fedfm_flower.methods.registry.ResolvedMethod``): once per run
on the
server, given to the strategy; once per run config in a client process, given to every message's
runtime; and a client computes its split once per message."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from flwr.app import Context, RecordDict
from torch import nn
from torch.utils.data import TensorDataset

from client_apps.base import ClientRuntime, resolved_run_config
from client_apps.split import SplitClient
from fedfm_flower.config.experiment import ExperimentConfig, NodeIdentity
from fedfm_flower.methods import registry
from fedfm_flower.methods.halves import client_class, strategy_class
from fedfm_flower.models import TrainableTensors
from fedfm_flower.models.groups import GroupPattern, TunedModel
from fedfm_flower.records.client_state import ClientStateStore
from fedfm_flower.tasks.classification import ImageClassification
from strategies.fedavg import FedAvgStrategy
from strategies.parts.context import RunContext
from tests.run_configs import method_base

# One parameter of every group a method's split may name (ViT, LLM and multi-modal groups).
GROUPS = {
    "adapter.global.a": "adapter.global",
    "adapter.local.a": "adapter.local",
    "prompt.p": "prompt",
    "prefix.p": "prefix",
    "mlp-adapter.w": "mlp-adapter",
    "vit.mlp.w": "vit.mlp",
    "vit.attn.w": "vit.attn",
    "encoder.image.w": "encoder.image",
    "mome.shared.w": "mome.shared",
    "head.w": "head",
}


class CountingMethods(dict):
    """The registry's ``METHODS`` that counts lookups by name (``method_spec`` reads it)."""

    lookups = 0

    def __getitem__(self, name: str) -> object:
        self.lookups += 1
        return super().__getitem__(name)


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingMethods]:
    """Count every ``method_spec`` lookup from here on."""
    counting = CountingMethods(registry.METHODS)
    monkeypatch.setattr(registry, "METHODS", counting)
    yield counting


def _configs() -> Iterator[tuple[str, ExperimentConfig]]:
    """Every registered method's config, and on a backbone of another family where a whole-ViT
    method adapts to it (its tuner and ``trains_backbone`` then differ)."""
    for method in registry.METHODS:
        config = ExperimentConfig.from_run_config(method_base(method))
        yield method, config
        yield f"{method}-llm", dataclasses.replace(config, backbone="tiny-llama")
        yield f"{method}-tuned", dataclasses.replace(config, tuner="lora", train_backbone=True)


CONFIGS = dict(_configs())


@pytest.mark.parametrize("label", list(CONFIGS))
def test_the_resolved_method_is_what_the_one_question_functions_answer(label: str) -> None:
    config = CONFIGS[label]
    method = registry.resolve(config)
    assert method.spec is registry.method_spec(config.method)
    assert method.name == config.method
    assert method.tuner == registry.tuner_of(config)
    assert method.trains_backbone == registry.trains_backbone(config)
    assert method.split == method.spec.split_for(config)
    assert method == registry.resolve(config)  # equal however often resolved
    for groups in (GROUPS, {n: g for n, g in GROUPS.items() if g != "prefix"}, {}):
        try:
            expected = registry.split_parameters(config, groups)
        except ValueError as err:  # a strict split (FedPerfix) that selects nothing
            with pytest.raises(ValueError, match=re.escape(str(err))):
                method.split_names(groups)
            continue
        assert method.split_names(groups) == expected
        assert method.split_names(groups) == expected  # remembered: the same answer


def test_whole_vit_methods_adapt_to_another_family_in_the_resolved_method() -> None:
    assert registry.resolve(CONFIGS["fedbabu"]).tuner == "none"
    assert registry.resolve(CONFIGS["fedbabu"]).trains_backbone
    adapted = registry.resolve(CONFIGS["fedbabu-llm"])
    assert adapted.tuner == "lora" and not adapted.trains_backbone
    assert registry.resolve(CONFIGS["fedperfix-llm"]).trains_backbone  # needs a ViT: kept


def test_split_names_are_fresh_lists_remembered_per_groups(
    lookups: CountingMethods, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedfm_flower.models import groups as groups_module

    method = registry.resolve(CONFIGS["fedrep"])
    lookups.lookups = 0
    calls = []
    original = groups_module.split_names
    monkeypatch.setattr(
        groups_module, "split_names", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    shared, local = method.split_names(GROUPS)
    assert local == ["head.w"] and "head.w" not in shared
    shared.append("changed")
    local.clear()
    assert method.split_names(dict(GROUPS)) == (
        [n for n in GROUPS if n != "head.w"],
        ["head.w"],
    )  # a caller's change is not remembered; equal groups are the same entry
    assert len(calls) == 1
    method.split_names({"head.w": "head"})  # other groups: computed
    assert len(calls) == 2 and lookups.lookups == 0


# ----------------------------------------------------------------------------- server


def _initial() -> TrainableTensors:
    tensors = {"vit.mlp.w": torch.ones(3), "head.w": torch.zeros(2)}
    return TrainableTensors(tensors, {"vit.mlp.w": "vit.mlp", "head.w": "head"})


def test_building_a_strategy_looks_the_method_up_once(
    lookups: CountingMethods, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server_apps import runner
    from server_apps.runner import build_strategy

    config = CONFIGS["fedrep"]
    built: list[tuple[str, bool]] = []

    def initial_trainable(
        config: ExperimentConfig, tuner: str, outputs: int, train_backbone: bool
    ) -> TrainableTensors:
        built.append((tuner, train_backbone))
        return _initial()

    monkeypatch.setattr(runner, "initial_trainable", initial_trainable)
    lookups.lookups = 0
    strategy = build_strategy(config)
    assert lookups.lookups == 1
    assert isinstance(strategy, FedAvgStrategy)
    assert strategy.method == registry.resolve(config)
    assert built == [(strategy.method.tuner, strategy.method.trains_backbone)]
    assert set(strategy.global_tensors) == {"vit.mlp.w"}  # FedRep keeps the head

    lookups.lookups = 0
    context = RunContext(run_name="r", method=registry.resolve(config))
    given = build_strategy(config, context)
    assert lookups.lookups == 1  # the context's own resolution; the build adds none
    assert given.method is context.method


def test_a_strategy_refuses_a_context_resolved_for_another_method() -> None:
    context = RunContext(method=registry.resolve(CONFIGS["fedavg"]))
    with pytest.raises(ValueError, match="resolved method 'fedavg' for a 'fedrep' config"):
        FedAvgStrategy(CONFIGS["fedrep"], _initial(), context)


def test_the_halves_take_a_resolved_spec_without_a_lookup(lookups: CountingMethods) -> None:
    spec = registry.METHODS["pfedpg"]
    lookups.lookups = 0
    assert strategy_class(spec) is strategy_class("pfedpg")
    assert client_class(spec) is client_class("pfedpg")
    assert lookups.lookups == 2  # the two by name only


# ----------------------------------------------------------------------------- client


def test_a_client_process_resolves_once_per_run_config(lookups: CountingMethods) -> None:
    run_config = {**method_base("fedrep"), "run-name": "resolve-once-test"}
    lookups.lookups = 0
    config, method = resolved_run_config(dict(run_config))
    again_config, again = resolved_run_config(dict(run_config))  # the next message
    assert again_config is config and again is method
    assert method == registry.resolve(config)
    context = Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": 1, "num-partitions": 2},
        state=RecordDict(),
        run_config=dict(run_config),
    )
    runtime = ClientRuntime.from_context(context, "run")
    assert runtime.method is method and runtime.config is config
    assert lookups.lookups <= 2  # parsing validates the method once; resolving looks it up once


class TwoGroupModel(TunedModel):
    """A body (group ``vit.mlp``) and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)
        self.group_patterns = (
            GroupPattern("vit.mlp", r"^body\."),
            GroupPattern("head", r"^head\."),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _data(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,)))


def _runtime(model: TwoGroupModel, config: ExperimentConfig, state_dir: Path) -> ClientRuntime:
    """One message's runtime on ``model`` (reset per message) and hand-made data."""
    store = ClientStateStore(RecordDict(), 0, "run", str(state_dir))
    device = torch.device("cpu")
    runtime = ClientRuntime(config, NodeIdentity(0, 0, 2), store, device, registry.resolve(config))
    initial = dict(model.trainable().tensors)

    def fresh() -> TunedModel:
        model.load_tensors(initial)
        return model

    runtime.model = fresh  # type: ignore[method-assign]
    runtime.__dict__["task"] = ImageClassification()
    runtime.__dict__["data"] = SimpleNamespace(train=_data(12, 1), test=_data(6, 2))
    return runtime


@pytest.mark.parametrize("method", ["fedavg", "fedrep"])
def test_a_training_message_selects_its_parameters_once(
    method: str, tmp_path: Path, lookups: CountingMethods, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = TwoGroupModel()
    config = ExperimentConfig(method=method, lr=0.1, batch_size=4, local_epochs=1)
    selections = []
    names_for = model.names_for
    monkeypatch.setattr(model, "names_for", lambda holds: selections.append(1) or names_for(holds))
    received = {n: t + 0.5 for n, t in model.trainable().tensors.items() if n.startswith("body")}
    for server_round in (1, 2):  # two messages, each with its own runtime
        runtime = _runtime(model, config, tmp_path)
        logic = client_class(runtime.method.spec)()
        assert isinstance(logic, SplitClient)
        lookups.lookups = 0
        selections.clear()
        logic.evaluate(runtime, received, server_round - 1)  # a fused message evaluates first
        sent, _ = logic.train(runtime, received, server_round)
        assert selections == [1], "the split is computed once per message"
        assert lookups.lookups == 0
        # What it sends is what the registry's function selects among the model's groups.
        shared, _ = registry.split_parameters(config, model.parameter_groups())
        assert list(sent) == shared
        assert runtime.split(model) == registry.split_parameters(config, model.parameter_groups())
    assert set(runtime.store.rounds()) == ({1, 2} if method == "fedrep" else set())
