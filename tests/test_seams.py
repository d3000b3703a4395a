"""The seams every method builds on: tasks, parameter groups, families and tuners, aggregation
over owners, optional reply keys, client capabilities and the post-training phase."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from fedfm_flower.config.experiment import ConfigError, ExperimentConfig
from fedfm_flower.learners.aggregation import average_over_owners, client_weights, weighted_average
from fedfm_flower.models import TrainableTensors, build_model
from fedfm_flower.models.groups import GroupPattern, check_group_name, group_of, in_groups

# ------------------------------------------------------------------ aggregation over owners


def test_each_tensor_is_averaged_over_the_clients_that_sent_it() -> None:
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([10.0])
    updates = [{"shared": a, "only-0": c}, {"shared": b}, {"shared": b * 2, "only-2": a}]
    weights = [1.0, 3.0, 4.0]
    out = average_over_owners(updates, weights)
    # independent arithmetic: the shared tensor over all three, the others over their one owner
    expected = (1 * a + 3 * b + 4 * (b * 2)) / 8
    torch.testing.assert_close(out["shared"], expected, rtol=0, atol=1e-6)
    assert torch.equal(out["only-0"], c) and torch.equal(out["only-2"], a)
    assert list(out) == ["shared", "only-0", "only-2"]


def test_owner_average_equals_fedavg_when_everyone_sends_everything() -> None:
    g = torch.Generator().manual_seed(0)
    updates = [
        {"x": torch.randn(3, 4, generator=g), "y": torch.randn(5, generator=g)} for _ in "abc"
    ]
    weights = [5.0, 1.0, 2.0]
    owners = average_over_owners(updates, weights)
    for name in ("x", "y"):
        manual = sum(w * u[name].double() for u, w in zip(updates, weights, strict=True)) / 8
        assert torch.equal(owners[name], manual.float())
    assert all(torch.equal(owners[k], v) for k, v in weighted_average(updates, weights).items())


def test_weightings_and_their_errors() -> None:
    assert client_weights([10, 30], "examples") == [10.0, 30.0]
    assert client_weights([10, 30], "uniform") == [1.0, 1.0]  # FedDPA eq. 2: 1/M
    assert client_weights([0, 0], "examples") == [1.0, 1.0]
    with pytest.raises(ValueError, match="weighting 'size'"):
        client_weights([1], "size")
    with pytest.raises(ValueError, match="different tensors"):
        weighted_average([{"x": torch.ones(1)}, {"y": torch.ones(1)}], [1.0, 1.0])
    with pytest.raises(ValueError, match="'x' has shape"):
        average_over_owners([{"x": torch.ones(2)}, {"x": torch.ones(3)}], [1.0, 1.0])
    with pytest.raises(ValueError, match="owners' weights sum to -1"):
        average_over_owners([{"x": torch.ones(2)}], [-1.0])


def test_a_tensor_whose_owners_all_weigh_zero_is_their_plain_mean() -> None:
    """Found by tests/test_properties_replies.py: TAP's decoder owned by clients reporting 0
    examples while the others report some raised ValueError and crashed the round. Like a
    round whose counts are all 0 (``client_weights``), its owners count equally."""
    updates = [{"enc": torch.ones(2), "dec": torch.ones(1)}, {"enc": 3 * torch.ones(2)}]
    updates.append({"enc": 5 * torch.ones(2), "dec": 3 * torch.ones(1)})
    out = average_over_owners(updates, client_weights([0, 10, 0], "examples"))
    assert torch.equal(out["enc"], 3 * torch.ones(2))  # client 1 alone weighs
    assert torch.equal(out["dec"], 2 * torch.ones(1))  # clients 0 and 2, equally


# ------------------------------------------------------------------ parameter groups


def test_group_patterns_first_match_and_dotted_children() -> None:
    patterns = (
        GroupPattern("adapter.global", r"\.lora_[AB]\.global\."),
        GroupPattern("adapter.local", r"\.lora_[AB]\.local\."),
        GroupPattern("head", r"^head\."),
    )
    assert group_of("lm.q_proj.lora_A.global.weight", patterns) == "adapter.global"
    assert group_of("lm.q_proj.lora_B.local.weight", patterns) == "adapter.local"
    assert group_of("lm.q_proj.base_layer.weight", patterns) == "backbone"
    assert in_groups("adapter.local", ["adapter"]) and not in_groups("adapters", ["adapter"])
    assert in_groups("expert.3", ["expert.3"]) and not in_groups("expert.30", ["expert.3"])
    for bad in ("Adapter", "backbone", "adapter..x", ""):
        with pytest.raises(ValueError, match="group name"):
            check_group_name(bad)


def test_named_lora_adapters_form_dotted_groups_and_are_seeded() -> None:
    from fedfm_flower.models.groups import TunedModel
    from fedfm_flower.models.tuners.lora import inject_lora, lora_patterns

    config = ExperimentConfig(pretrained=False)

    class TwoAdapters(TunedModel):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            inner = torch.nn.Sequential()
            inner.add_module("qkv", torch.nn.Linear(4, 12))
            self.body = inject_lora(inner, config, adapters=("global", "local"))
            self.group_patterns = lora_patterns(["global", "local"])

    model = TwoAdapters()
    groups = model.parameter_groups()
    assert sorted(set(groups.values())) == ["adapter.global", "adapter.local"]
    assert set(model.group_parameters(["adapter"])) == set(groups)  # both, by the parent name
    only_local = model.group_parameters(["adapter.local"])
    assert only_local and all(".local." in n for n in only_local)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n not in groups)
    again = TwoAdapters().trainable().tensors
    assert all(torch.equal(again[n], t) for n, t in model.trainable().tensors.items())


def test_trainable_tensors_select_in_model_order_and_copy() -> None:
    model = build_model(ExperimentConfig(pretrained=False), "lora", 3)
    trainable = model.trainable()
    assert trainable.group_names() == ("adapter", "head")
    selected = trainable.select(["head"])
    assert list(selected) == ["head.weight", "head.bias"]
    selected["head.bias"].add_(1.0)  # a copy: the model's tensors are untouched
    assert not torch.equal(selected["head.bias"], trainable.tensors["head.bias"])


def test_families_registry_agrees_with_config_and_checks_modality() -> None:
    from fedfm_flower.config.experiment import BACKBONES
    from fedfm_flower.data.registry import DATASETS
    from fedfm_flower.models.families import FAMILIES, family_of
    from fedfm_flower.tasks.registry import TASKS

    assert set(BACKBONES) == {b for f in FAMILIES.values() for b in f.backbones}
    assert {spec.task for spec in DATASETS.values()} <= set(TASKS)
    assert family_of("tiny-llama").modality == "text"
    with pytest.raises(ConfigError, match="backbone 'tiny-vit' is a image model"):
        ExperimentConfig(dataset="instructions", backbone="tiny-vit").validate()
    with pytest.raises(ConfigError, match="text model"):
        ExperimentConfig(dataset="digits", backbone="tiny-llama").validate()


def _card_of(config: ExperimentConfig) -> dict:
    """A foundation hook for the test: the card names the backbone it was asked for."""
    return {"prepared": config.backbone}


def test_foundation_preparation_is_the_family_hook(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import dataclasses
    import importlib

    from fedfm_flower.models import build
    from fedfm_flower.models.families import BACKBONES, FAMILIES

    for family in FAMILIES.values():  # every declared path names a function
        for path in filter(None, (family.builder, family.foundation)):
            module, _, name = path.partition(":")
            assert callable(getattr(importlib.import_module(module), name)), path
    hook = f"{__name__}:_card_of"
    monkeypatch.setitem(FAMILIES, "vit", dataclasses.replace(FAMILIES["vit"], foundation=hook))
    config = ExperimentConfig(backbone="small-vit")
    assert build.prepare_foundation(config) == {"prepared": "small-vit"}
    assert build.prepare_foundation(config.replace(pretrained=False)) == {}
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"")
    assert build.prepare_foundation(config.replace(weights_file=str(weights))) == {}
    monkeypatch.setitem(FAMILIES, "vit", dataclasses.replace(FAMILIES["vit"], foundation=""))
    assert build.prepare_foundation(config) == {}
    # The server names no backbone: what a backbone needs is its family's.
    runner = (Path(__file__).resolve().parent.parent / "server_apps" / "runner.py").read_text()
    assert not [b for b in BACKBONES if f'"{b}"' in runner]


def test_the_model_layer_does_not_import_the_method_registry() -> None:
    import ast

    root = Path(__file__).resolve().parent.parent / "fedfm_flower" / "models"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "fedfm_flower.methods.registry", path
            if isinstance(node, ast.Import):
                assert all(a.name != "fedfm_flower.methods.registry" for a in node.names), path


# ------------------------------------------------------------------ the task seam


def test_classification_task_step_and_evaluate_match_a_direct_computation() -> None:
    from fedfm_flower.tasks.classification import ImageClassification

    task = ImageClassification()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    x, y = torch.randn(20, 6), torch.randint(0, 3, (20,))
    step = task.step(model, (x[:8], y[:8]))
    logits = model(x[:8])
    assert torch.equal(step.loss, torch.nn.functional.cross_entropy(logits, y[:8]))
    assert step.count == 8 and step.sums == {"accuracy": int((logits.argmax(1) == y[:8]).sum())}
    stats = task.evaluate(model, TensorDataset(x, y), torch.device("cpu"), batch_size=7)
    with torch.no_grad():
        full = model(x)
    assert stats.metrics == {"accuracy": int((full.argmax(1) == y).sum()) / 20}
    assert stats.loss == pytest.approx(torch.nn.functional.cross_entropy(full, y).item())
    assert stats.num_examples == 20


# ------------------------------------------------------------------ strategies and messages


def _fedavg_with_heads(num_clients: int = 2):
    from server_apps.inprocess import InProcessGrid, identity_app
    from strategies.fedavg import FedAvgStrategy

    initial = TrainableTensors(
        {"encoder.w": torch.zeros(2), "decoder.w": torch.zeros(3)},
        {"encoder.w": "encoder", "decoder.w": "decoder"},
    )

    class Components(FedAvgStrategy):
        def required_reply_keys(self, client_id: int) -> set[str] | None:
            return set()  # each client sends the components it owns

    config = ExperimentConfig(method="fedavg", num_clients=num_clients)  # both shared
    nodes = [{"client-id": i, "capabilities": ["image", "image,text"][i]} for i in range(2)]
    grid = InProcessGrid(identity_app(), config.to_run_config(), nodes)
    return Components(config, initial), grid


def test_components_owned_by_some_clients_are_averaged_over_their_owners() -> None:
    from flwr.app import Message, MetricRecord, RecordDict

    from fedfm_flower.records import protocol as P
    from fedfm_flower.records.messages import to_array_record

    strategy, grid = _fedavg_with_heads()
    messages = list(strategy.configure_train(1, None, {}, grid))
    sends = {
        0: {"encoder.w": torch.tensor([2.0, 2.0])},
        1: {"encoder.w": torch.tensor([4.0, 8.0]), "decoder.w": torch.ones(3)},
    }
    replies = []
    for message in messages:
        client = int(message.content[P.CONFIG][P.CLIENT_ID])
        assert message.content[P.CONFIG][P.PHASE] == "train"
        metrics = MetricRecord({P.CLIENT_ID: client, P.NUM_EXAMPLES: [10, 30][client]})
        content = RecordDict({P.ARRAYS: to_array_record(sends[client]), P.METRICS: metrics})
        replies.append(Message(content, reply_to=message))
    strategy.aggregate_train(1, replies)
    assert torch.equal(strategy.global_tensors["encoder.w"], torch.tensor([3.5, 6.5]))
    assert torch.equal(strategy.global_tensors["decoder.w"], torch.ones(3))  # its one owner
    assert strategy.nodes.capabilities == {0: frozenset({"image"}), 1: frozenset({"image", "text"})}


# ------------------------------------------------------------------ the post-training phase


def _post_training_method(monkeypatch: pytest.MonkeyPatch, rounds: int = 1) -> None:
    """Make 'fedavg' a FedAvg with ``rounds`` post-training rounds of local head tuning."""
    import dataclasses

    import fedfm_flower.methods.halves as halves
    import fedfm_flower.methods.registry as registry
    import server_apps.runner as runner
    from client_apps.split import SplitClient
    from fedfm_flower.methods import Split
    from strategies.fedavg import FedAvgStrategy
    from strategies.parts.context import RunContext

    class PostTrainStrategy(FedAvgStrategy):
        def post_training_rounds(self) -> int:
            return rounds

        def required_reply_keys(self, client_id: int) -> set[str] | None:
            return set() if self.phase(self.current_round) == "post-training" else None

        def configure_train(self, server_round, arrays, config, grid):  # noqa: ANN001, ANN201
            self.current_round = server_round
            return super().configure_train(server_round, arrays, config, grid)

    class PostTrainClient(SplitClient):
        def post_train(self, runtime, received, server_round):  # noqa: ANN001, ANN201
            model = self.prepare(runtime, received, {"before": server_round})
            heads = model.group_parameters(["head"])
            stats = runtime.train(model, heads, runtime.seed(server_round))
            runtime.store.save(server_round, model.group_tensors(["head"]))
            return {}, stats

    # The post-training head lives in client state too.
    split = Split(shared=("adapter", "head"), local=("head",))
    monkeypatch.setitem(
        registry.METHODS, "fedavg", dataclasses.replace(registry.METHODS["fedavg"], split=split)
    )
    original = halves.client_class
    monkeypatch.setattr(
        halves,
        "client_class",
        lambda method: PostTrainClient if method.name == "fedavg" else original(method),
    )

    def build_strategy(config: ExperimentConfig, context: RunContext):  # noqa: ANN202
        from fedfm_flower.models import initial_trainable

        return PostTrainStrategy(config, initial_trainable(config, "lora", 10), context)

    monkeypatch.setattr(runner, "build_strategy", build_strategy)


def test_post_training_rounds_run_after_the_last_round_and_resume(
    small_run_config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server_apps.inprocess import ServerCrash, crash_in_round, run_in_process

    _post_training_method(monkeypatch)
    base = {**small_run_config, "method": "fedavg", "num-clients": 2, "local-steps": 2}
    full, grid = run_in_process({**base, "run-name": "whole"}, 2)
    run_dir = Path(base["output-dir"]) / "whole"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["phase"]) for r in records] == [
        (1, "train"),
        (2, "train"),
        (3, "post-training"),
    ]
    post = [
        m for m in grid.sent if m.metadata.group_id == "3" and m.metadata.message_type == "train"
    ]
    assert post and all(m.content["config"]["phase"] == "post-training" for m in post)
    assert records[2]["bytes-up-train"] == 0  # the post-training replies carry no tensors
    assert (run_dir / "checkpoints" / "round_00003.safetensors").is_file()
    assert full["rounds"] == 3 and "evaluate" in records[2]
    # The federated state is not changed by the post-training round.
    with pytest.raises(ServerCrash):
        run_in_process({**base, "run-name": "crashed"}, 2, crash_in_round(3))
    resumed, _ = run_in_process({**base, "run-name": "crashed", "resume": True}, 2)
    assert resumed["final-per-client-accuracy"] == full["final-per-client-accuracy"]


def test_parsing_the_run_config_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from fedfm_flower.config.experiment import ExperimentConfig\n"
        "ExperimentConfig.from_run_config(ExperimentConfig().to_run_config())\n"
        "ExperimentConfig(dataset='instructions', backbone='tiny-llama').validate()\n"
        "print(sorted(m for m in ('torch', 'transformers', 'flwr') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"  # the ClientApp parses the config per message
