"""Config parsing and validation: every bad value fails naming key, value and rule."""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fedfm_flower.config import (
    BACKBONES,
    DATASETS,
    METHODS,
    ConfigError,
    ExperimentConfig,
    NodeIdentity,
)
from fedfm_flower.registry import METHODS as REGISTRY

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_declares_every_key_with_the_dataclass_default() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = pyproject["tool"]["flwr"]["app"]["config"]
    assert declared == ExperimentConfig().to_run_config()
    assert ExperimentConfig.from_run_config(declared) == ExperimentConfig()


def test_methods_match_the_registry() -> None:
    assert set(METHODS) == set(REGISTRY)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("method", "fedprox", "allowed: local, fedavg"),
        ("dataset", "mnist", "allowed: digits"),
        ("backbone", "resnet50", "allowed: tiny-vit"),
        ("partitioner", "shards", "allowed: iid"),
        ("num-server-rounds", 0, "must be > 0"),
        ("num-server-rounds", -3, "must be > 0"),
        ("dirichlet-alpha", 0.0, "must be > 0"),
        ("dirichlet-alpha", -1.0, "must be > 0"),
        ("fraction-train", 0.0, "(0, 1]"),
        ("fraction-train", 1.5, "(0, 1]"),
        ("fraction-evaluate", -0.1, "(0, 1]"),
        ("weights-file", "/nonexistent/vit.safetensors", "no such file"),
        ("data-dir", "/nonexistent/data", "no such directory"),
        ("lr", 0.0, "must be > 0"),
        ("optimizer", "lbfgs", "allowed: sgd"),
        ("test-fraction", 1.0, "(0, 1)"),
        ("num-server-rounds", "ten", "expected a value of type int"),
        ("num-server-rounds", 2.5, "expected a value of type int"),
        ("resume", "maybe", "expected a value of type bool"),
        ("lora-target-modules", " , ", "name at least one module"),
        ("colour", "red", "unknown key"),
        ("partitioner", "natural-id", "has no natural ids"),
    ],
)
def test_invalid_values_name_key_value_and_rule(key: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        ExperimentConfig.from_run_config({key: value})
    message = str(info.value)
    assert f"'{key}'" in message
    assert repr(value) in message
    assert fragment in message


def test_natural_id_needs_a_dataset_with_ids() -> None:
    with pytest.raises(ConfigError, match="'tiny-imagenet' has no natural ids"):
        ExperimentConfig.from_run_config({"dataset": "tiny-imagenet", "partitioner": "natural-id"})
    config = ExperimentConfig.from_run_config(
        {"dataset": "digits-domains", "partitioner": "natural-id"}
    )
    assert config.partitioner == "natural-id"


def test_resume_needs_a_run_name() -> None:
    with pytest.raises(ConfigError, match="'resume'"):
        ExperimentConfig.from_run_config({"resume": True})


def test_values_are_coerced_from_cli_strings() -> None:
    config = ExperimentConfig.from_run_config(
        {"num-server-rounds": "7", "lr": "0.1", "resume": "false", "fraction-train": 1}
    )
    assert config.num_server_rounds == 7
    assert config.lr == 0.1
    assert config.resume is False
    assert config.fraction_train == 1.0


def test_registry_names_are_all_accepted() -> None:
    for method in METHODS:
        assert ExperimentConfig.from_run_config({"method": method}).method == method
    for name in DATASETS:
        partitioner = "iid"
        assert ExperimentConfig.from_run_config({"dataset": name, "partitioner": partitioner})
    for name in BACKBONES:
        assert ExperimentConfig.from_run_config({"backbone": name}).backbone == name


def test_node_identity_from_simulation_and_deployment_configs(tmp_path: Path) -> None:
    config = ExperimentConfig()
    sim = NodeIdentity.from_node_config({"partition-id": 3, "num-partitions": 5}, config)
    assert (sim.client_id, sim.partition_id, sim.num_partitions) == (3, 3, 5)
    deployed = NodeIdentity.from_node_config(
        {"client-id": 7, "partition-id": 1, "num-partitions": 4, "state-dir": str(tmp_path)},
        config,
    )
    assert (deployed.client_id, deployed.partition_id, deployed.state_dir) == (7, 1, str(tmp_path))


@pytest.mark.parametrize(
    ("node_config", "fragment"),
    [
        ({}, "node config 'client-id' = None is invalid: missing"),
        ({"partition-id": 5, "num-partitions": 4}, "must lie in [0, 4)"),
        ({"partition-id": 0}, "num-partitions"),
    ],
)
def test_bad_node_configs_fail_clearly(node_config: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        NodeIdentity.from_node_config(node_config, ExperimentConfig())
    assert fragment in str(info.value)


def test_num_clients_must_match_the_node_partitions() -> None:
    config = ExperimentConfig(num_clients=10)
    with pytest.raises(ConfigError, match="num-partitions=4"):
        NodeIdentity.from_node_config({"partition-id": 0, "num-partitions": 4}, config)
