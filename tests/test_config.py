"""Config parsing and validation: every bad value fails naming key, value and rule."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fedfm_flower.config.experiment import (
    METHODS,
    ConfigError,
    ExperimentConfig,
    NodeIdentity,
)
from fedfm_flower.methods.pfedpg import PFedPGSettings
from fedfm_flower.methods.pfedseq import PFedSeqSettings
from fedfm_flower.methods.registry import METHODS as REGISTRY
from fedfm_flower.methods.registry import settings_class, settings_classes
from fedfm_flower.methods.settings import MethodSettings, allowed_values
from tests.user_dirs import with_user_dirs

ROOT = Path(__file__).resolve().parent.parent


def declared_defaults() -> dict[str, object]:
    """Run-config key -> default: ExperimentConfig's fields and every registered settings'."""
    defaults: dict[str, object] = {
        f.name.replace("_", "-"): f.default
        for f in dataclasses.fields(ExperimentConfig)
        if f.name != "method_values"
    }
    for kind in settings_classes():
        defaults.update({kind.key_of(f.name): f.default for f in dataclasses.fields(kind)})
    return defaults


def test_pyproject_declares_every_key_with_the_dataclass_default() -> None:
    """pyproject.toml's [tool.flwr.app.config] == the common keys + every method's settings."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = pyproject["tool"]["flwr"]["app"]["config"]
    keys = ExperimentConfig.keys()
    assert len(set(keys)) == len(keys)
    missing, extra = sorted(set(keys) - set(declared)), sorted(set(declared) - set(keys))
    assert not missing, f"missing in pyproject.toml: {missing}"
    assert not extra, f"in pyproject.toml but no dataclass declares them: {extra}"
    defaults = declared_defaults()
    assert set(defaults) == set(keys)
    for key, value in declared.items():
        assert value == defaults[key], f"{key}: pyproject {value!r}, dataclass {defaults[key]!r}"
    assert declared == ExperimentConfig().to_run_config()
    assert ExperimentConfig.from_run_config(declared) == ExperimentConfig()


def test_method_settings_are_registered_under_their_own_prefix() -> None:
    # Every settings class of a spec, once, each declared in the method module of its spec.
    specs = [spec for spec in REGISTRY.values() if spec.settings is not None]
    assert settings_classes() == tuple(dict.fromkeys(spec.settings for spec in specs))
    for spec in specs:
        assert spec.settings.__module__.startswith("fedfm_flower.methods."), spec.name
    common = {f.name.replace("_", "-") for f in dataclasses.fields(ExperimentConfig)}
    seen: set[str] = set()
    for kind in settings_classes():
        assert issubclass(kind, MethodSettings) and kind.prefix
        assert all(key.startswith(f"{kind.prefix}-") for key in kind.keys())
        assert not set(kind.keys()) & (common | seen)
        seen |= set(kind.keys())
        kind()  # the defaults are valid
    assert set(ExperimentConfig.method_keys()) == seen
    for method in REGISTRY:
        config = ExperimentConfig.from_run_config({"method": method, **_model_for(method)})
        kind = settings_class(method)
        if kind is None:
            assert config.method_settings is None
        else:
            assert config.method_settings == kind() and config.method_settings is not None
    assert settings_class("pfedseq") is PFedSeqSettings
    assert settings_class("pfedpg") is PFedPGSettings
    assert settings_class("fedavg") is None


def _other_value(kind: type[MethodSettings], f: dataclasses.Field) -> object:
    """A valid value of field ``f`` other than its default, from its rules."""
    key, default, rules = kind.key_of(f.name), f.default, f.metadata
    choices = allowed_values(f)
    if choices:
        return next(c for c in choices if c != default)
    if isinstance(default, bool):
        return not default
    if isinstance(default, str):  # free-form: its declaration gives an example
        assert rules.get("example") not in (None, default), f"{key}: declare example=..."
        return rules["example"]
    lo, hi = rules.get("within") or (-math.inf, math.inf)
    step = 1 if isinstance(default, int) else 0.5 * (min(hi, default + 1) - default or 1)
    return (
        default + step if default + step <= hi else default - step if default - step >= lo else lo
    )


def non_default_values() -> dict[str, object]:
    """Every method key with a valid value other than its default, derived from the registry."""
    values: dict[str, object] = {}
    for kind in settings_classes():
        changed = {kind.key_of(f.name): _other_value(kind, f) for f in dataclasses.fields(kind)}
        kind.from_run_config(changed)  # valid together
        values.update(changed)
    return values


NON_DEFAULT = non_default_values()


def test_typed_settings_hold_the_run_config_values() -> None:
    assert set(NON_DEFAULT) == set(ExperimentConfig.method_keys())  # every key, changed
    assert all(NON_DEFAULT[key] != declared_defaults()[key] for key in NON_DEFAULT)
    as_cli = {
        key: str(value).lower() if isinstance(value, bool) else str(value)
        for key, value in NON_DEFAULT.items()
    }
    for run_config in (NON_DEFAULT, as_cli):  # typed (TOML) or strings (CLI overrides)
        config = ExperimentConfig.from_run_config({"method": "fedavg", **run_config})
        for kind in settings_classes():
            typed = config.settings_of(kind)
            assert typed.to_run_config() == {k: NON_DEFAULT[k] for k in kind.keys()}
            assert typed == kind.from_run_config(NON_DEFAULT)
            assert config.settings_of(kind) is typed  # parsed once per config value
        assert {k: v for k, v in config.to_run_config().items() if k in NON_DEFAULT} == NON_DEFAULT
        assert config.method_settings is None  # fedavg has no keys of its own
        pg = config.settings_of(PFedPGSettings)
        assert config.replace(method="pfedpg").method_settings == pg


def test_method_values_take_part_in_equality_hashing_and_replace() -> None:
    base = ExperimentConfig()
    changed = base.replace(pfedseq_lr=0.01, seed=3)
    parsed = ExperimentConfig.from_run_config({"pfedseq-lr": 0.01, "seed": 3})
    assert changed == parsed and hash(changed) == hash(parsed)
    assert changed != base and changed.replace(pfedseq_lr=0.001, seed=0) == base
    assert changed.settings_of(PFedSeqSettings).lr == 0.01
    assert base.settings_of(PFedSeqSettings) == PFedSeqSettings()
    assert len({base, changed, parsed}) == 2  # usable as a cache key
    order = ExperimentConfig(method_values=(("pfedpg-lr", 0.1), ("pfedseq-lr", 0.2)))
    assert order == base.replace(pfedseq_lr=0.2, pfedpg_lr=0.1)  # however they are written
    with pytest.raises(ConfigError, match="'pfedseq-learner' = 'gru'"):
        base.replace(pfedseq_learner="gru")
    with pytest.raises(TypeError):
        base.replace(pfedseq_colour="red")
    with pytest.raises(ConfigError, match="'pfedseq-colour'"):
        ExperimentConfig(method_values=(("pfedseq-colour", "red"),))
    settings = PFedSeqSettings().replace(seq_len=4)
    assert settings.seq_len == 4 and changed.settings_of(PFedSeqSettings).lr == 0.01


def test_settings_of_needs_a_registered_class() -> None:
    @dataclasses.dataclass(frozen=True)
    class Stray(MethodSettings):
        prefix = "stray"
        width: int = 3

    with pytest.raises(ValueError, match="not a registered"):
        ExperimentConfig().settings_of(Stray)


def test_method_settings_import_neither_torch_nor_flwr() -> None:
    """The ClientApp parses the run config in a fresh process per message."""
    script = (
        "import sys, json\n"
        "from fedfm_flower.config.experiment import ExperimentConfig\n"
        "from fedfm_flower.methods.registry import settings_classes\n"
        "kinds = settings_classes()\n"
        "assert kinds and [k.from_run_config({}) for k in kinds]\n"
        "c = ExperimentConfig(method_values=(('pfedpg-lr', 0.1),))\n"
        "from fedfm_flower.methods.registry import settings_class\n"
        "pg = c.settings_of(settings_class('pfedpg'))\n"
        "assert c.method_settings.lr == 0.001 and pg.lr == 0.1\n"
        "print(json.dumps(sorted(m for m in ('torch', 'flwr') if m in sys.modules)))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []


def test_methods_match_the_registry() -> None:
    assert set(METHODS) == set(REGISTRY)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("method", "fedsgd", "allowed: apfl, apple, centralized, ditto, fedala, fedavg"),
        ("dataset", "mnist", "allowed: digits"),
        ("backbone", "convnext_tiny", "allowed: tiny-vit"),
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
        ("pfedseq-seq-length", 3, "unknown key"),
        ("pfedseq_lr", 0.1, "unknown key"),
        ("method-values", "", "unknown key"),
        ("pfedseq-learner", "gru", "allowed: mamba, lstm, mlp"),
        ("pfedseq-scan-backend", "triton", "allowed: auto, torch, cuda, compiled"),
        ("pfedseq-conv-kernel", 5, "must lie in [2, 4]"),
        ("pfedseq-lr", 0.0, "must be > 0"),
        ("pfedseq-warmup-rounds", -1, "must be >= 0"),
        ("pfedseq-cross-client", "maybe", "expected a value of type bool"),
        ("pfedpg-generator", "film", "allowed: cross-attention, basis, mlp, adain"),
        ("pfedpg-query", "multi", "allowed: per-prompt, single"),
        ("pfedpg-hidden", "wide", "expected a value of type int"),
        ("pfedpg-attention-dim", -2, "must be >= 0"),
        ("partitioner", "natural-id", "has no natural ids"),
        # found by tests/test_properties_config.py: a NUL raised ValueError from the path checks
        ("weights-file", "w\x00.safetensors", "must not contain a NUL character"),
        ("data-dir", "\x00", "must not contain a NUL character"),
        ("run-name", "a\x00b", "must not contain a NUL character"),
    ],
)
def test_invalid_values_name_key_value_and_rule(key: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        ExperimentConfig.from_run_config({key: value})
    message = str(info.value)
    assert f"'{key}'" in message
    assert repr(value) in message
    assert fragment in message


@pytest.mark.parametrize("method", ["fedavg", "pfedseq", "pfedpg"])
def test_every_methods_settings_are_validated_whatever_the_method(method: str) -> None:
    """A bad pfedpg-* value is an error in a pfedseq run too: config files hold every key."""
    for key, value in (("pfedpg-generator", "film"), ("pfedseq-learner", "gru")):
        with pytest.raises(ConfigError, match=f"'{key}'"):
            ExperimentConfig.from_run_config({"method": method, key: value})


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


def _model_for(method: str) -> dict[str, str]:
    """A dataset and backbone of a modality ``method`` serves (the defaults when it serves all)."""
    served = REGISTRY[method].modalities or ("image",)
    if "image" in served:
        return {}
    if "multimodal" in served:
        return {"dataset": "multitask", "backbone": "mm-offline"}
    return {"dataset": "instructions", "backbone": "tiny-llama"}


def test_registry_names_are_all_accepted() -> None:
    for method in METHODS:
        config = ExperimentConfig.from_run_config({"method": method, **_model_for(method)})
        assert config.method == method
    from fedfm_flower.data.registry import DATASETS, dataset_spec
    from fedfm_flower.models.families import FAMILIES
    from fedfm_flower.tasks.registry import task_modality

    backbone_for: dict[str, str] = {}
    for family in FAMILIES.values():  # the first (offline) backbone of each modality
        backbone_for.setdefault(family.modality, family.backbones[0])
    for name in DATASETS:
        backbone = backbone_for[task_modality(dataset_spec(name).task)]
        config = {"dataset": name, "partitioner": "iid", "backbone": backbone}
        assert ExperimentConfig.from_run_config(config)
    dataset_for = {"image": "digits", "text": "instructions", "multimodal": "multitask"}
    for family in FAMILIES.values():
        for name in family.backbones:
            config = {"backbone": name, "dataset": dataset_for[family.modality]}
            if family.tuners:  # the default method's LoRA is not among a ResNet's tuners
                config.update(method="fedavg", tuner=family.tuners[0])
            assert ExperimentConfig.from_run_config(config).backbone == name


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


def test_every_config_file_in_the_repository_parses(tmp_path: Path) -> None:
    import tomllib

    files = sorted((ROOT / "configs").rglob("*.toml"))
    assert len(files) > 50
    for path in files:
        if path.parent.name == "tables":
            continue  # a paper's table, not a run config: tests/test_paper_tables.py checks those
        values = tomllib.loads(path.read_text())
        values = with_user_dirs(values, tmp_path)  # the authors' data, never here
        # A method's overlay is checked with a setup of its modality underneath; a transfer
        # setup's (configs/transfer/<setup>/) with its setup underneath.
        if path.parent.parent.name == "transfer":
            setup = ROOT / "configs" / "setups" / f"{path.parent.name}.toml"
            base = tomllib.loads(setup.read_text())
        else:
            base = {} if path.parent.name == "setups" else _model_for(path.parent.name)
            if "mm-backbone-routing" in values:  # a multi-modal overlay (configs/*/standard.toml)
                base = {"dataset": "multitask", "backbone": "mm-offline"}
        try:
            ExperimentConfig.from_run_config({**base, **values})
        except ConfigError as err:
            raise AssertionError(f"{path.relative_to(ROOT)}: {err}") from err


def test_the_launchers_check_refuses_a_path_with_a_nul_by_its_key() -> None:
    """Found by tests/test_properties_config.py: making the path absolute raised ValueError
    ("embedded null byte") before the config's check could name the key."""
    from fedfm_flower.simulation.preflight import PreflightError, resolve_config

    root = Path(__file__).resolve().parent.parent
    with pytest.raises(PreflightError, match="'output-dir' = 'runs\\\\x00' is invalid: must not"):
        resolve_config(root, {"output-dir": "runs\x00"})
