"""The ServerApp's cache of initial trainable tensors (fedfm_flower.models.initial_cache)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.build import build_model, initial_trainable
from fedfm_flower.models.groups import TrainableTensors
from fedfm_flower.models.initial_cache import (
    INERT_KEYS,
    cached_initial,
    initial_key,
    initial_path,
    read_initial,
    source_digest,
    write_initial,
)

ROOT = Path(__file__).resolve().parent.parent
# A value other than the default for every inert key (all valid together with the defaults).
ALTERNATIVES = {
    "num-server-rounds": 3,
    "fraction-train": 0.5,
    "fraction-evaluate": 0.5,
    "min-train-clients": 2,
    "sample-per-task": True,
    "eval-every": 2,
    "fused-evaluation": False,
    "prompt-replies": False,
    "round-timeout": 30.0,
    "max-failed-rounds": 2,
    "cache-dir": "/nonexistent/elsewhere",
    "local-epochs": 3,
    "local-steps": 5,
    "head-epochs": 2,
    "finetune-epochs": 2,
    "finetune-steps": 4,
    "batch-size": 7,
    "optimizer": "adamw",
    "lr": 0.5,
    "momentum": 0.5,
    "weight-decay": 0.1,
    "device": "cpu",
    "output-dir": "elsewhere",
    "run-name": "other",
    "label": "other",
    "setup": "other",
    "resume": True,
    "keep-checkpoints": 5,
    "client-state-dir": "/tmp/elsewhere",
    "tensorboard": True,
    "wandb": True,
    "wandb-project": "other",
    "wandb-entity": "other",
    "wandb-mode": "offline",
    "mlflow": True,
    "mlflow-tracking-uri": "file:/tmp/elsewhere",
    "mlflow-experiment": "other",
    "dp": "central",
    "dp-clipping-norm": 0.5,
    "dp-noise-multiplier": 0.3,
    "dp-delta": 1e-6,
    "dp-target-epsilon": 8.0,
    "secagg": True,
    "secagg-num-shares": 3.0,
    "secagg-clipping-range": 4.0,
    "secagg-quantization-range": 1024,
    "secagg-max-weight": 10.0,
    "secagg-threshold": 0.7,
}
TUNERS = ("lora", "vpt-deep", "perfix")


def _base(cache_dir: Path) -> ExperimentConfig:
    return ExperimentConfig.from_run_config(
        {"cache-dir": str(cache_dir), "num-clients": 4, "run-name": "base", "method": "fedavg"}
    )


def _assert_same(a: TrainableTensors, b: TrainableTensors) -> None:
    assert list(a.tensors) == list(b.tensors)  # model order
    for name, tensor in a.tensors.items():
        assert tensor.dtype == b.tensors[name].dtype and torch.equal(tensor, b.tensors[name]), name
    assert dict(a.groups) == dict(b.groups) and dict(a.users) == dict(b.users)


def _fresh(config: ExperimentConfig, tuner: str) -> TrainableTensors:
    return build_model(config, tuner, 10, load_weights=False).trainable()


def test_every_inert_key_has_an_alternative_value() -> None:
    assert set(ALTERNATIVES) == INERT_KEYS
    assert INERT_KEYS < set(ExperimentConfig.keys())


@pytest.mark.parametrize("tuner", TUNERS)
def test_an_inert_key_changes_neither_the_built_tensors_nor_the_key(
    tuner: str, tmp_path: Path
) -> None:
    base = _base(tmp_path)
    reference, key = _fresh(base, tuner), initial_key(base, tuner, 10)
    for name, value in ALTERNATIVES.items():
        changed = base.replace(**{name.replace("-", "_"): value})
        assert initial_key(changed, tuner, 10) == key, name
        _assert_same(_fresh(changed, tuner), reference)


@pytest.mark.parametrize(
    "change", [{"seed": 1}, {"lora_rank": 2}, {"image_size": 32}, {"pfedseq_lr": 0.01}]
)
def test_a_key_that_may_shape_the_model_changes_the_key(change: dict, tmp_path: Path) -> None:
    base = _base(tmp_path)
    assert initial_key(base.replace(**change), "lora", 10) != initial_key(base, "lora", 10)
    assert initial_key(base, "vpt", 10) != initial_key(base, "lora", 10)
    assert initial_key(base, "lora", 3) != initial_key(base, "lora", 10)


def test_a_change_of_the_package_source_changes_its_digest(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    before = source_digest(tmp_path)
    source_digest.cache_clear()
    (tmp_path / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != before
    source_digest.cache_clear()


@pytest.mark.parametrize("tuner", ["lora", "vpt-deep", "perfix", "dual-lora"])
def test_a_cached_entry_is_the_built_tensors_bit_for_bit(tuner: str, tmp_path: Path) -> None:
    config = _base(tmp_path)
    built = []

    def build() -> TrainableTensors:
        built.append(1)
        return _fresh(config, tuner)

    first = cached_initial(config, tuner, 10, build)
    again = cached_initial(config, tuner, 10, build)
    assert len(built) == 1 and initial_path(config, tuner, 10).is_file()
    _assert_same(again, first)
    _assert_same(again, _fresh(config, tuner))


def test_names_groups_and_users_survive_the_cache(tmp_path: Path) -> None:
    initial = TrainableTensors(
        {"z.w": torch.arange(3.0), "a.w": torch.ones(2, 2, dtype=torch.bfloat16)},
        {"z.w": "head", "a.w": "adapter.image"},
        {"a.w": frozenset({"image-cls", "image-seg"})},
    )
    path = tmp_path / "entry.safetensors"
    write_initial(path, initial)
    _assert_same(read_initial(path), initial)


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: path.write_bytes(path.read_bytes()[:100]),  # truncated tensors
        lambda path: path.write_bytes(path.read_bytes()[:-9] + b"\x7f" * 9),  # flipped values
        lambda path: path.with_suffix(".json").write_text("{not json"),
        lambda path: path.with_suffix(".json").write_text(
            json.dumps({"names": ["x"], "groups": {"x": "adapter"}, "users": {}})
        ),
    ],
    ids=["truncated", "bit-flipped", "bad-json", "other-names"],
)
def test_a_damaged_entry_is_built_again_and_replaced(
    damage, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _base(tmp_path)
    cached_initial(config, "lora", 10, lambda: _fresh(config, "lora"))
    damage(initial_path(config, "lora", 10))
    built = []

    def build() -> TrainableTensors:
        built.append(1)
        return _fresh(config, "lora")

    with caplog.at_level("WARNING"):
        result = cached_initial(config, "lora", 10, build)
    assert built and "damaged" in caplog.text
    _assert_same(result, _fresh(config, "lora"))
    _assert_same(cached_initial(config, "lora", 10, lambda: pytest.fail("rebuilt")), result)


def test_an_unwritable_cache_costs_only_the_build(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = _base(blocker)  # its cache path lies under a regular file
    result = cached_initial(config, "lora", 10, lambda: _fresh(config, "lora"))
    _assert_same(result, _fresh(config, "lora"))


def test_a_trainable_backbone_is_not_cached(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedfm_flower.models import build as build_module

    monkeypatch.setattr(build_module, "cached_initial", lambda *a: pytest.fail("cached"))
    config = _base(cache_dir).replace(pretrain_epochs=30, method="fedbabu")
    initial = initial_trainable(config, "none", 10, train_backbone=True)
    assert any(group.startswith("vit") for group in initial.groups.values())


def test_a_serverapp_with_a_warm_cache_imports_neither_timm_nor_peft(tmp_path: Path) -> None:
    from server_apps.runner import build_strategy

    config = {"cache-dir": str(tmp_path)}
    build_strategy(ExperimentConfig.from_run_config(config))  # the first run fills the cache
    code = (
        "import json, sys\n"
        "from fedfm_flower.config.experiment import ExperimentConfig\n"
        "from server_apps.runner import build_strategy\n"
        f"build_strategy(ExperimentConfig.from_run_config({config!r}))\n"
        "print(json.dumps([m for m in ('timm', 'peft', 'transformers') if m in sys.modules]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(run.stdout.splitlines()[-1]) == []
