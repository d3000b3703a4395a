"""The typed, validated experiment configuration, parsed once from Flower's run config.

Every run-config key is declared once, with its type, default, rules and a one-line doc: the
common keys in groups by concern (``fedfm_flower.config.keys``; the tuners' in
``fedfm_flower.models.tuners.keys``), which ``ExperimentConfig`` inherits, so field ``lora_rank``
is key ``lora-rank``; a method's own keys (``pfedseq-*``, ``pfedpg-*``) in its method module
(``fedfm_flower/methods/<method>.py``) as a ``MethodSettings`` class
(``fedfm_flower.methods.settings``) that its spec names. ``[tool.flwr.app.config]`` in
``pyproject.toml`` (Flower rejects overrides of keys that are not there) and
docs/configuration.md's key tables are generated from the declarations (``python -m
fedfm_flower.config.schema --write``). ``ExperimentConfig.from_run_config`` checks every value
against its declared rules, then the rules across keys and registries, and fails at start with an
error that names the key, the value and what is allowed.

The config carries every registered method's values in ``method_values`` and hands out the
typed object, ``config.settings_of(PFedSeqSettings)`` or ``config.method_settings`` for the
active method.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfm_flower.config.keys import (
    NATURAL_ID_PARTITIONERS,
    DataKeys,
    FederationKeys,
    ModelKeys,
    OutputKeys,
    PrivacyKeys,
    SecAggKeys,
    TrackerKeys,
    TrainingKeys,
)
from fedfm_flower.data.registry import dataset_spec, looks_like_hub_name
from fedfm_flower.methods.registry import METHODS as METHOD_REGISTRY
from fedfm_flower.methods.registry import (
    settings_class,
    settings_classes,
    trains_backbone,
    tuner_of,
)
from fedfm_flower.methods.settings import (
    ConfigError,
    MethodSettings,
    SettingsT,
    check_value,
    coerce,
    require_package,
)
from fedfm_flower.models.families import BACKBONES as FAMILY_BACKBONES
from fedfm_flower.models.families import ModelFamily, family_of
from fedfm_flower.models.tuners.keys import (
    LoraKeys,
    MlpAdapterKeys,
    PrefixKeys,
    PromptKeys,
    TunerKeys,
)
from fedfm_flower.privacy.support import dp_refusal, secagg_refusal
from fedfm_flower.tasks.registry import task_has_validation, task_modality

METHODS: tuple[str, ...] = tuple(METHOD_REGISTRY)
BACKBONES: tuple[str, ...] = FAMILY_BACKBONES  # fedfm_flower.models.families

# The groups of common keys, in the order of pyproject.toml and the docs; ExperimentConfig
# inherits them in reverse, as a dataclass collects its bases' fields from the last base.
GROUPS: tuple[type, ...] = (
    FederationKeys,
    DataKeys,
    ModelKeys,
    TunerKeys,
    LoraKeys,
    PrefixKeys,
    MlpAdapterKeys,
    PromptKeys,
    TrainingKeys,
    OutputKeys,
    TrackerKeys,
    PrivacyKeys,
    SecAggKeys,
)


def data_seed_of(seed: int, data_seed: int) -> int:
    """The seed a run's data come from: ``data_seed``, or ``seed`` when that is -1."""
    return seed if data_seed < 0 else data_seed


@dataclass(frozen=True)
class ExperimentConfig(
    SecAggKeys,
    PrivacyKeys,
    TrackerKeys,
    OutputKeys,
    TrainingKeys,
    PromptKeys,
    MlpAdapterKeys,
    PrefixKeys,
    LoraKeys,
    TunerKeys,
    ModelKeys,
    DataKeys,
    FederationKeys,
):
    """All settings of one experiment; field ``foo_bar`` is run-config key ``foo-bar``.

    The fields are the key groups' (``GROUPS``), then ``method_values``: the keys of every
    registered method's settings class, as ``(run-config key, value)`` pairs in
    ``method_keys()`` order (missing keys take their default), so equality and hashing include
    them; read them typed with ``settings_of``.
    """

    method_values: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        # Every registered method key, in method_keys() order, with its default where missing:
        # equal settings give equal (and equally hashed) configs however they were written.
        defaults = _method_defaults()
        given = dict(self.method_values)
        for key, value in given.items():
            if key not in defaults:
                raise ConfigError(key, value, "not a key of any registered method's settings")
        values = tuple((key, given.get(key, default)) for key, default in defaults.items())
        object.__setattr__(self, "method_values", values)

    @staticmethod
    def keys() -> tuple[str, ...]:
        """All run-config keys (kebab-case) this config understands, methods' keys included."""
        return tuple(ExperimentConfig().to_run_config())

    @staticmethod
    def method_keys() -> tuple[str, ...]:
        """The run-config keys of every registered method's settings class."""
        return tuple(_method_defaults())

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> ExperimentConfig:
        """Parse and validate Flower's run config; unknown keys are an error too."""
        common, methods = _common_defaults(), _method_defaults()
        values: dict[str, Any] = {}
        method_values: dict[str, Any] = {}
        for key, raw in run_config.items():
            if key in common:
                values[key.replace("-", "_")] = coerce(key, raw, type(common[key]))
            elif key in methods:
                method_values[key] = coerce(key, raw, type(methods[key]))
            else:
                raise ConfigError(key, raw, f"unknown key; known keys: {', '.join(cls.keys())}")
        config = cls(**values, method_values=tuple(method_values.items()))
        config.validate()
        return config

    def to_run_config(self) -> dict[str, Any]:
        """The kebab-case mapping Flower would pass for this config (every method's keys too)."""
        mapping: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "method_values":
                mapping.update(self.method_values)
            else:
                mapping[f.name.replace("_", "-")] = getattr(self, f.name)
        return mapping

    def replace(self, **changes: Any) -> ExperimentConfig:
        """A validated copy with some fields changed (snake_case names).

        A method's settings go by their run-config key in snake case, e.g. ``pfedseq_lr``.
        """
        methods = _method_defaults()
        method_changes = {
            name.replace("_", "-"): changes.pop(name)
            for name in list(changes)
            if name.replace("_", "-") in methods
        }
        if method_changes:
            merged = {**dict(changes.pop("method_values", self.method_values)), **method_changes}
            changes["method_values"] = tuple(merged.items())
        config = dataclasses.replace(self, **changes)
        config.validate()
        return config

    def settings_of(self, kind: type[SettingsT]) -> SettingsT:
        """The typed, validated settings ``kind`` (a registered MethodSettings class)."""
        return _typed_settings(kind, self.method_values)

    @property
    def method_settings(self) -> MethodSettings | None:
        """The active method's typed settings; None for a method without keys of its own."""
        kind = settings_class(self.method)
        return None if kind is None else self.settings_of(kind)

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid value: every key's declared rules, every
        registered method's settings, then the rules across keys and registries."""
        for group in GROUPS:
            for f in dataclasses.fields(group):
                check_value(f.name.replace("_", "-"), getattr(self, f.name), f)
        # Every registered method's values, not only the active one's: a bad value in a
        # config file fails now, not when someone switches the method.
        for kind in settings_classes():
            self.settings_of(kind)
        self._check_model_loading()
        self._check_modality()
        self._check_training()
        self._check_data()
        self._check_privacy()
        self._check_secagg()
        self._check_trackers()
        if self.resume and not self.run_name:
            raise ConfigError("resume", True, "needs 'run-name' naming the run to resume")

    def _check_training(self) -> None:
        if self.local_epochs == 0 and self.local_steps == 0:
            raise ConfigError("local-epochs", 0, "must be > 0 unless local-steps > 0")
        if not self.target_modules:
            raise ConfigError(
                "lora-target-modules", self.lora_target_modules, "name at least one module"
            )

    def _check_data(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0 or self.val_fraction + self.test_fraction >= 1.0:
            raise ConfigError(
                "val-fraction", self.val_fraction, "must be >= 0 with val + test fraction < 1"
            )
        self._check_evaluation_split()
        if self.weights_file and not Path(self.weights_file).expanduser().is_file():
            raise ConfigError("weights-file", self.weights_file, "no such file")

        hub_id = self.dataset == "flan" and looks_like_hub_name(self.data_dir)  # flan by Hub id
        if self.data_dir and not hub_id and not Path(self.data_dir).expanduser().is_dir():
            reads_a_file = bool(dataset_spec(self.dataset).medmnist_flag)  # data-dir: the .npz
            if not (reads_a_file and Path(self.data_dir).expanduser().is_file()):
                what = "no such directory or file" if reads_a_file else "no such directory"
                raise ConfigError("data-dir", self.data_dir, what)
        if self.partitioner in NATURAL_ID_PARTITIONERS and not self.natural_id_column:
            if not dataset_spec(self.dataset).natural_id_column:
                raise ConfigError(
                    "partitioner",
                    self.partitioner,
                    f"dataset '{self.dataset}' has no natural ids; set natural-id-column",
                )
        if self.multitask_style_skew and self.dataset != "multitask":
            raise ConfigError(
                "multitask-style-skew",
                True,
                f"applies to dataset 'multitask' only, not '{self.dataset}'",
            )
        self._check_unseen()

    def _check_unseen(self) -> None:
        """``unseen-test-dir`` and ``unseen-tasks``: test-time tasks outside the federation (the
        instruction task checks their tasks, at preflight too: ``example_counts``)."""
        for key, value in (
            ("unseen-test-dir", self.unseen_test_dir),
            ("unseen-tasks", self.unseen_tasks),
        ):
            if value and not self.test_time_evaluation:
                raise ConfigError(key, value, "needs test-time-evaluation = true")
            if value and dataset_spec(self.dataset).task != "instruction-following":
                raise ConfigError(
                    key,
                    value,
                    f"applies to text datasets 'instructions' and 'flan', not '{self.dataset}'",
                )
        if self.unseen_test_dir and not Path(self.unseen_test_dir).expanduser().is_dir():
            raise ConfigError("unseen-test-dir", self.unseen_test_dir, "no such directory")
        if self.unseen_tasks and self.dataset != "instructions":
            raise ConfigError(
                "unseen-tasks",
                self.unseen_tasks,
                f"names offline tasks of dataset 'instructions', not '{self.dataset}' (use "
                "unseen-test-dir)",
            )

    @property
    def unseen_task_names(self) -> tuple[str, ...]:
        """``unseen-tasks`` as names, in order, each once."""
        names = (name.strip() for name in self.unseen_tasks.split(","))
        return tuple(dict.fromkeys(name for name in names if name))

    def _check_trackers(self) -> None:
        if self.wandb and not self.wandb_project:
            raise ConfigError("wandb-project", self.wandb_project, "must not be empty")
        if self.mlflow and not self.mlflow_experiment:
            raise ConfigError("mlflow-experiment", self.mlflow_experiment, "must not be empty")

    def _check_privacy(self) -> None:
        if self.dp == "none":
            return
        refusal = dp_refusal(self)
        if refusal is not None:
            raise ConfigError("dp", self.dp, f"method {self.method!r} cannot take it: {refusal}")

    def _check_secagg(self) -> None:
        if self.secagg_num_shares > 1 and (
            self.secagg_num_shares < 3 or not float(self.secagg_num_shares).is_integer()
        ):
            raise ConfigError(
                "secagg-num-shares",
                self.secagg_num_shares,
                "as a count must be a whole number >= 3",
            )
        # A count of 1 would let the server unmask a round with one survivor: that client's
        # update itself. Flower refuses threshold 1 as an int; 1.5 must not become it either.
        if self.secagg_threshold > 1 and (
            self.secagg_threshold < 2 or not float(self.secagg_threshold).is_integer()
        ):
            raise ConfigError(
                "secagg-threshold", self.secagg_threshold, "as a count must be a whole number >= 2"
            )
        if self.secagg_num_shares > 1 and self.secagg_threshold >= self.secagg_num_shares:
            raise ConfigError(
                "secagg-threshold", self.secagg_threshold, "must be below secagg-num-shares"
            )
        if not self.secagg:
            return
        refusal = secagg_refusal(self)
        if refusal is not None:
            raise ConfigError(
                "secagg", self.secagg, f"method {self.method!r} cannot take it: {refusal}"
            )

    def _check_model_loading(self) -> None:
        """model-dtype, device-map, load-in-4bit: hf-causal-lm only, their packages installed.

        Packages are looked up with ``find_spec`` (nothing is imported); that CUDA is there is
        checked when the model loads (``fedfm_flower.models.language.foundation``).
        """

        if self.backbone != "hf-causal-lm":
            for key, value, default in (
                ("model-dtype", self.model_dtype, "auto"),
                ("device-map", self.device_map, ""),
                ("load-in-4bit", self.load_in_4bit, False),
            ):
                if value != default:
                    raise ConfigError(
                        key,
                        value,
                        f"applies to backbone 'hf-causal-lm' only, not '{self.backbone}'",
                    )
        if self.device_map == "auto":
            if self.device == "cpu":
                raise ConfigError(
                    "device-map",
                    "auto",
                    "places the model on the GPUs itself; with device 'cpu' leave it empty",
                )
            require_package("device-map", "auto", "accelerate")
        if self.load_in_4bit:
            if self.device == "cpu":
                raise ConfigError("load-in-4bit", True, "needs a CUDA GPU; device is 'cpu'")
            require_package("load-in-4bit", True, "bitsandbytes", " and a CUDA GPU")

    def _check_evaluation_split(self) -> None:

        if self.evaluation_split != "val":
            return
        if self.val_fraction <= 0:
            raise ConfigError("evaluation-split", "val", "needs val-fraction > 0")
        task = dataset_spec(self.dataset).task
        if not task_has_validation(task):
            raise ConfigError(
                "evaluation-split",
                "val",
                f"dataset '{self.dataset}' (task '{task}') has no validation split",
            )

    def _check_modality(self) -> None:

        task = dataset_spec(self.dataset).task
        family = family_of(self.backbone)
        if self.mm_backbone_routing != "experts":
            if family.modality != "multimodal":
                raise ConfigError(
                    "mm-backbone-routing",
                    self.mm_backbone_routing,
                    f"applies to the multi-modal backbones only, not '{self.backbone}'",
                )
            if self.method == "tap":
                raise ConfigError(
                    "mm-backbone-routing",
                    self.mm_backbone_routing,
                    "TAP runs on its modality-task architecture (experts) only, as in the paper",
                )
        if not family.whole and trains_backbone(self):
            raise ConfigError(
                "train-backbone",
                True,
                f"backbone '{self.backbone}' (family '{family.name}') is tuned with adapters "
                f"only; method '{self.method}' and train-backbone need a ViT or a ResNet",
            )
        if family.tuners or family.batchnorm:  # the ResNets
            self._check_family_tuning(family)
        served = METHOD_REGISTRY[self.method].modalities
        if served and family.modality not in served:
            raise ConfigError(
                "method",
                self.method,
                f"it serves {' or '.join(served)} models; backbone '{self.backbone}' is a "
                f"{family.modality} model (family '{family.name}')",
            )
        if task_modality(task) != family.modality:
            raise ConfigError(
                "backbone",
                self.backbone,
                f"dataset '{self.dataset}' is a {task} task on {task_modality(task)} input; "
                f"backbone '{self.backbone}' is a {family.modality} model (family "
                f"'{family.name}'); choose a backbone of a {task_modality(task)} family",
            )

    def _check_family_tuning(self, family: ModelFamily) -> None:
        """The method's tuner is one ``family`` takes, and the method can carry the BatchNorm
        statistics of its models."""
        why_not = METHOD_REGISTRY[self.method].no_batchnorm
        if family.batchnorm and why_not:
            raise ConfigError(
                "method",
                self.method,
                f"backbone '{self.backbone}' keeps BatchNorm statistics, which '{self.method}' "
                f"cannot carry: {why_not}; run it on a ViT",
            )
        tuner = tuner_of(self)
        if family.tuners and tuner not in family.tuners:
            resolved = "" if tuner == self.tuner else f" (method '{self.method}''s: {tuner!r})"
            raise ConfigError(
                "tuner",
                self.tuner,
                f"backbone '{self.backbone}' (family '{family.name}') takes the tuner "
                f"{' or '.join(repr(t) for t in family.tuners)} only, not this one{resolved}",
            )

    @property
    def effective_data_seed(self) -> int:
        """The seed of the data: ``data-seed``, or ``seed`` when that is -1."""
        return data_seed_of(self.seed, self.data_seed)

    @property
    def target_modules(self) -> list[str]:
        """LoRA target module names from the comma-separated config value."""
        return [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]

    @property
    def cache_path(self) -> Path:
        """Directory for cached foundation models and partition plans.

        ``cache-dir`` when set, else ``$XDG_CACHE_HOME/fedfm-flower`` (``~/.cache/fedfm-flower``
        when that variable is unset, the XDG default).
        """
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        return default_cache_path()


def default_cache_path() -> Path:
    """``$XDG_CACHE_HOME/fedfm-flower`` (``~/.cache/fedfm-flower`` when that variable is unset,
    the XDG default): the caches' home when ``cache-dir`` is empty."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fedfm-flower"


@dataclass(frozen=True)
class NodeIdentity:
    """Who a ClientApp is: its stable client id, its partition, and where its state lives."""

    client_id: int
    partition_id: int
    num_partitions: int
    state_dir: str = field(default="")

    @classmethod
    def from_node_config(
        cls, node_config: Mapping[str, Any], experiment: ExperimentConfig
    ) -> NodeIdentity:
        """Read identity from Flower's node config (simulation or deployment)."""
        pid_raw = node_config.get("partition-id", node_config.get("client-id"))
        if pid_raw is None:
            raise ConfigError(
                "client-id",
                None,
                f"missing; this SuperNode's node config {dict(node_config)} needs 'client-id' "
                "(deployment) or 'partition-id' (simulation)",
                source="node config",
            )
        partition_id = coerce("partition-id", pid_raw, int)
        client_id = coerce("client-id", node_config.get("client-id", partition_id), int)
        num_raw = node_config.get("num-partitions", experiment.num_clients)
        num_partitions = coerce("num-partitions", num_raw, int)
        if experiment.num_clients and num_partitions != experiment.num_clients:
            raise ConfigError(
                "num-clients",
                experiment.num_clients,
                f"differs from the node config's num-partitions={num_partitions}; "
                "set num-clients=0 or match the number of SuperNodes",
            )
        if num_partitions <= 0:
            raise ConfigError(
                "num-clients", num_partitions, "set num-clients (or node num-partitions) > 0"
            )
        if not 0 <= partition_id < num_partitions:
            raise ConfigError(
                "partition-id",
                partition_id,
                f"must lie in [0, {num_partitions})",
                source="node config",
            )
        state_dir = str(node_config.get("state-dir", experiment.client_state_dir) or "")
        return cls(client_id, partition_id, num_partitions, state_dir)


@functools.cache
def _common_defaults() -> dict[str, Any]:
    """Run-config key -> default of every ExperimentConfig field but ``method_values``."""
    return {
        f.name.replace("_", "-"): f.default
        for f in dataclasses.fields(ExperimentConfig)
        if f.name != "method_values"
    }


@functools.cache
def _method_defaults() -> dict[str, Any]:
    """Run-config key -> default of every registered method's settings, in registry order."""
    defaults: dict[str, Any] = {}
    for kind in settings_classes():
        if not issubclass(kind, MethodSettings) or not kind.prefix:
            raise TypeError(f"{kind.__name__} is not a MethodSettings class with a prefix")
        for key, default in kind.defaults().items():
            if key in defaults or key in _common_defaults():
                raise TypeError(f"run-config key '{key}' of {kind.__name__} is declared twice")
            defaults[key] = default
    return defaults


@functools.lru_cache(maxsize=64)
def _typed_settings(kind: type[SettingsT], values: tuple[tuple[str, Any], ...]) -> SettingsT:
    """``kind`` parsed from a config's method values (cached: configs are cache keys)."""
    if not set(kind.keys()) <= set(_method_defaults()):
        raise ValueError(f"{kind.__name__} is not a registered method's settings class")
    return kind.from_run_config(dict(values))
