"""The typed, validated experiment configuration, parsed once from Flower's run config.

Every key lives, with its default, under ``[tool.flwr.app.config]`` in ``pyproject.toml``
(kebab-case, because Flower rejects overrides of keys that are not declared there). The
dataclass fields are the snake_case twins of those keys. ``ExperimentConfig.from_run_config``
checks every value and fails at start with an error that names the key, the value and what
is allowed, so a typo never surfaces twenty minutes into a run.

A method's own keys (``pfedseq-*``, ``pfedpg-*``) are declared in its method module
(``fedfm_flower/methods/<method>.py``) as a ``MethodSettings`` class (``fedfm_flower.settings``)
that its spec names; the config carries every registered method's values in ``method_values``
and hands out the typed object,
``config.settings_of(PFedSeqSettings)`` or ``config.method_settings`` for the active method.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fedfm_flower.models.families import BACKBONES as FAMILY_BACKBONES
from fedfm_flower.models.families import family_of
from fedfm_flower.models.tuners import TUNERS
from fedfm_flower.registry import METHODS as METHOD_REGISTRY
from fedfm_flower.registry import settings_class, settings_classes, trains_backbone
from fedfm_flower.settings import (
    ConfigError,
    MethodSettings,
    coerce,
    require_finite,
    require_package,
)

# Names the config accepts. Registries elsewhere (methods, datasets, backbones) must agree
# with these tuples; tests check that they do.
METHODS: tuple[str, ...] = tuple(METHOD_REGISTRY)
DATASETS: tuple[str, ...] = (
    "digits",
    "digits-domains",
    "glyph-domains",
    "cifar100",
    "tiny-imagenet",
    "domainnet",
    "office-caltech10",
    "omniglot",
    "office-home",
    "organamnist",
    "instructions",
    "flan",
    "multitask",
)
BACKBONES: tuple[str, ...] = FAMILY_BACKBONES  # fedfm_flower.models.families
PARTITIONERS: tuple[str, ...] = (
    "iid",
    "dirichlet",
    "pathological",
    "natural-id",
    "domain-dirichlet",
)
NATURAL_ID_PARTITIONERS: tuple[str, ...] = ("natural-id", "domain-dirichlet")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")
EVALUATION_SPLITS: tuple[str, ...] = ("test", "val")  # the split every evaluation reads
TUNER_CHOICES: tuple[str, ...] = ("auto", *TUNERS)
WANDB_MODES: tuple[str, ...] = ("online", "offline")  # fedfm_flower.trackers.wandb
PREFIX_FORMS: tuple[str, ...] = ("parallel", "concat")  # fedfm_flower.models.tuners.prefix
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
MODEL_DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")  # hf-causal-lm only
DEVICE_MAPS: tuple[str, ...] = ("", "auto")  # hf-causal-lm only; "" loads on one device
# The methods' own allowed values (pfedseq-learner, pfedpg-generator, ...) are in their
# settings classes, in their method modules: fedfm_flower/methods/<method>.py.

SettingsT = TypeVar("SettingsT", bound=MethodSettings)


@dataclass(frozen=True)
class ExperimentConfig:
    """All settings of one experiment; field ``foo_bar`` is run-config key ``foo-bar``.

    ``method_values`` holds the keys of every registered method's settings class, as
    ``(run-config key, value)`` pairs in ``method_keys()`` order (missing keys take their
    default), so equality and hashing include them; read them typed with ``settings_of``.
    """

    # federation
    method: str = "pfedseq"
    num_server_rounds: int = 20
    num_clients: int = 0  # 0: take it from the node config's num-partitions
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_train_clients: int = 1
    sample_per_task: bool = False  # sample fraction-train of each client task's clients
    eval_every: int = 1
    # round t's evaluation rides on round t+1's training messages (one phase per round) where
    # the method allows it (strategies.base.PersonalizedStrategy.fuses_evaluation)
    fused_evaluation: bool = True
    # pull replies every 0.01-0.1 s (server_apps.polling) instead of Flower's own send_and_receive
    prompt_replies: bool = True
    round_timeout: float = 600.0
    max_failed_rounds: int = 0  # consecutive rounds with no usable reply tolerated (0: none)
    seed: int = 0
    # data
    dataset: str = "digits"
    data_dir: str = ""
    partitioner: str = "dirichlet"
    dirichlet_alpha: float = 0.3
    classes_per_client: int = 2
    natural_id_column: str = ""
    min_train_examples: int = 10  # per client; a smaller partition fails at start
    min_test_examples: int = 5
    test_fraction: float = 0.2
    val_fraction: float = 0.0
    evaluation_split: str = "test"  # val: evaluate on the validation split (tuning); test unread
    public_fraction: float = 0.3
    # multitask: an image pair's holders each get one glyph style instead of a mix of all
    multitask_style_skew: bool = False
    image_size: int = 16
    max_length: int = 96  # text tasks: tokens per training example (prompt + response)
    max_new_tokens: int = 16  # text tasks: tokens generated per evaluation prompt
    test_time_evaluation: bool = False  # text tasks: also score every other client's task
    # model
    backbone: str = "tiny-vit"
    pretrained: bool = True
    weights_file: str = ""
    cache_dir: str = ""
    model_name_or_path: str = ""  # hf-causal-lm, mm-flava, mm-vilt: a Hub name or local path
    model_dtype: str = "auto"  # hf-causal-lm: auto is float32 on CPU, the checkpoint's on CUDA
    device_map: str = ""  # hf-causal-lm: "auto" lets transformers/accelerate place the model
    load_in_4bit: bool = False  # hf-causal-lm: 4-bit NF4 weights (bitsandbytes, CUDA)
    pretrain_epochs: int = 40
    lora_rank: int = 4
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    lora_target_modules: str = "qkv"
    tuner: str = "auto"  # what is added to the backbone; auto: the method's own
    train_backbone: bool = False  # the ViT's own weights train too (groups vit.*)
    prefix_bottleneck: int = 256  # perfix: width of the prefix adapter
    prefix_scale: float = 1.5  # perfix, prefix-*: s in eq. 5 of FedPerfix
    prefix_form: str = "parallel"  # parallel (added to keys/values) or concat (appended)
    mlp_adapter_bottleneck: int = 256  # mlp-adapter: width of the adapters
    # local training
    local_epochs: int = 1
    local_steps: int = 0  # >0 replaces epochs by a fixed number of optimizer steps
    head_epochs: int = 1  # fedrep: head epochs before the adapter epochs
    finetune_epochs: int = 1  # *-ft, fedbabu: fine-tuning epochs before each evaluation
    finetune_steps: int = 0  # >0 replaces finetune-epochs by a fixed number of optimizer steps
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 0.0
    device: str = "auto"
    # visual prompts (fedvpt, fedvpt-deep, pfedpg)
    vpt_num_prompts: int = 10
    # every registered method's own keys (pfedseq-*, pfedpg-*): fedfm_flower.registry's
    # MethodSpec.settings; run-config keys and typed values via method_keys() and settings_of()
    method_values: tuple[tuple[str, Any], ...] = ()
    # outputs and state
    output_dir: str = "runs"
    run_name: str = ""
    label: str = ""  # the method's name in reports (e.g. pfedpg:basis-only); "" -> method
    setup: str = ""  # the setup's name in reports (e.g. glyphs-feature-skew); "" -> dataset
    tensorboard: bool = False  # also log each round's metrics to <run-dir>/tensorboard
    wandb: bool = False  # also log to Weights & Biases (fedfm_flower.trackers.wandb)
    wandb_project: str = "fedfm-flower"
    wandb_entity: str = ""  # "": the account's default entity
    wandb_mode: str = "online"  # offline: files under <run-dir>/wandb, no network
    mlflow: bool = False  # also log to MLflow (fedfm_flower.trackers.mlflow)
    mlflow_tracking_uri: str = ""  # "": a SQLite store <output-dir>/mlflow.db
    mlflow_experiment: str = "fedfm-flower"
    # differential privacy of the shared updates (fedfm_flower.privacy): none, central, local
    dp: str = "none"
    dp_clipping_norm: float = 1.0  # C: L2 bound of each client's shared update
    dp_noise_multiplier: float = 1.0  # sigma: noise std on the sum of updates, in units of C
    dp_delta: float = 1e-5  # delta of the (epsilon, delta) reported per round
    dp_target_epsilon: float = 0.0  # > 0: sigma chosen to spend this over num-server-rounds
    # secure aggregation of the shared updates (fedfm_flower.privacy.secagg): Flower's SecAgg+
    secagg: bool = False
    secagg_num_shares: float = 1.0  # <= 1: fraction of the sampled clients; > 1: a count
    secagg_threshold: float = 0.5  # shares that rebuild a secret: <= 1 fraction; > 1 count
    secagg_clipping_range: float = 8.0  # |update value| bound before quantization
    secagg_quantization_range: int = 4194304  # 2**22 levels over [-range, range]
    secagg_max_weight: float = 1000.0  # the largest client weight (example count)
    resume: bool = False
    keep_checkpoints: int = 2
    client_state_dir: str = ""

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
        """Raise ConfigError naming the first invalid value."""
        for f in dataclasses.fields(self):  # the methods' keys: their settings' validate()
            require_finite(f.name.replace("_", "-"), getattr(self, f.name))
        _one_of("method", self.method, METHODS)
        _one_of("dataset", self.dataset, DATASETS)
        _one_of("backbone", self.backbone, BACKBONES)
        _one_of("partitioner", self.partitioner, PARTITIONERS)
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        _one_of("device", self.device, DEVICES)
        _one_of("model-dtype", self.model_dtype, MODEL_DTYPES)
        _one_of("device-map", self.device_map, DEVICE_MAPS)
        self._check_model_loading()
        _one_of("tuner", self.tuner, TUNER_CHOICES)
        _one_of("prefix-form", self.prefix_form, PREFIX_FORMS)
        _positive("prefix-bottleneck", self.prefix_bottleneck)
        _positive("prefix-scale", self.prefix_scale)
        _positive("mlp-adapter-bottleneck", self.mlp_adapter_bottleneck)
        # Every registered method's values, not only the active one's: a bad value in a
        # config file fails now, not when someone switches the method.
        for kind in settings_classes():
            self.settings_of(kind)
        _positive("vpt-num-prompts", self.vpt_num_prompts)
        _positive("num-server-rounds", self.num_server_rounds)
        _positive("eval-every", self.eval_every)
        _positive("image-size", self.image_size)
        _positive("max-length", self.max_length)
        _positive("max-new-tokens", self.max_new_tokens)
        self._check_modality()
        _positive("batch-size", self.batch_size)
        _positive("lora-rank", self.lora_rank)
        _positive("classes-per-client", self.classes_per_client)
        _positive("keep-checkpoints", self.keep_checkpoints)
        _positive("round-timeout", self.round_timeout)
        _positive("lr", self.lr)
        _positive("dirichlet-alpha", self.dirichlet_alpha)
        _positive("lora-alpha", self.lora_alpha)
        _positive("min-train-clients", self.min_train_clients)
        _positive("min-train-examples", self.min_train_examples)
        _positive("min-test-examples", self.min_test_examples)
        for key, value in (
            ("num-clients", self.num_clients),
            ("max-failed-rounds", self.max_failed_rounds),
            ("local-epochs", self.local_epochs),
            ("local-steps", self.local_steps),
            ("head-epochs", self.head_epochs),
            ("finetune-epochs", self.finetune_epochs),
            ("finetune-steps", self.finetune_steps),
            ("pretrain-epochs", self.pretrain_epochs),
            ("momentum", self.momentum),
            ("weight-decay", self.weight_decay),
        ):
            if value < 0:
                raise ConfigError(key, value, "must be >= 0")
        self._check_privacy()
        self._check_secagg()
        self._check_trackers()
        if self.local_epochs == 0 and self.local_steps == 0:
            raise ConfigError("local-epochs", 0, "must be > 0 unless local-steps > 0")
        for key, value in (
            ("fraction-train", self.fraction_train),
            ("fraction-evaluate", self.fraction_evaluate),
        ):
            if not 0.0 < value <= 1.0:
                raise ConfigError(key, value, "must lie in (0, 1]")
        for key, value in (
            ("test-fraction", self.test_fraction),
            ("public-fraction", self.public_fraction),
        ):
            if not 0.0 < value < 1.0:
                raise ConfigError(key, value, "must lie in (0, 1)")
        if not 0.0 <= self.val_fraction < 1.0 or self.val_fraction + self.test_fraction >= 1.0:
            raise ConfigError(
                "val-fraction", self.val_fraction, "must be >= 0 with val + test fraction < 1"
            )
        self._check_evaluation_split()
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError("lora-dropout", self.lora_dropout, "must lie in [0, 1)")
        if not self.target_modules:
            raise ConfigError(
                "lora-target-modules", self.lora_target_modules, "name at least one module"
            )
        if self.weights_file and not Path(self.weights_file).expanduser().is_file():
            raise ConfigError("weights-file", self.weights_file, "no such file")
        from fedfm_flower.data.flan import looks_like_hub_name

        hub_id = self.dataset == "flan" and looks_like_hub_name(self.data_dir)  # flan by Hub id
        if self.data_dir and not hub_id and not Path(self.data_dir).expanduser().is_dir():
            from fedfm_flower.data.registry import dataset_spec

            reads_a_file = bool(dataset_spec(self.dataset).medmnist_flag)  # data-dir: the .npz
            if not (reads_a_file and Path(self.data_dir).expanduser().is_file()):
                what = "no such directory or file" if reads_a_file else "no such directory"
                raise ConfigError("data-dir", self.data_dir, what)
        if self.partitioner in NATURAL_ID_PARTITIONERS and not self.natural_id_column:
            from fedfm_flower.data.registry import dataset_spec

            if not dataset_spec(self.dataset).natural_id_column:
                raise ConfigError(
                    "partitioner",
                    self.partitioner,
                    f"dataset '{self.dataset}' has no natural ids; set natural-id-column",
                )
        if self.resume and not self.run_name:
            raise ConfigError("resume", True, "needs 'run-name' naming the run to resume")
        if self.multitask_style_skew and self.dataset != "multitask":
            raise ConfigError(
                "multitask-style-skew",
                True,
                f"applies to dataset 'multitask' only, not '{self.dataset}'",
            )

    def _check_trackers(self) -> None:
        _one_of("wandb-mode", self.wandb_mode, WANDB_MODES)
        if self.wandb and not self.wandb_project:
            raise ConfigError("wandb-project", self.wandb_project, "must not be empty")
        if self.mlflow and not self.mlflow_experiment:
            raise ConfigError("mlflow-experiment", self.mlflow_experiment, "must not be empty")

    def _check_privacy(self) -> None:
        from fedfm_flower.privacy.support import DP_MODES, dp_refusal

        _one_of("dp", self.dp, DP_MODES)
        _positive("dp-clipping-norm", self.dp_clipping_norm)
        if self.dp_noise_multiplier < 0:
            raise ConfigError("dp-noise-multiplier", self.dp_noise_multiplier, "must be >= 0")
        if not 0.0 < self.dp_delta < 1.0:
            raise ConfigError("dp-delta", self.dp_delta, "must lie in (0, 1)")
        if self.dp_target_epsilon < 0:
            raise ConfigError("dp-target-epsilon", self.dp_target_epsilon, "must be >= 0")
        if self.dp == "none":
            return
        refusal = dp_refusal(self)
        if refusal is not None:
            raise ConfigError("dp", self.dp, f"method {self.method!r} cannot take it: {refusal}")

    def _check_secagg(self) -> None:
        from fedfm_flower.privacy.secagg import MODULUS_RANGE, secagg_refusal

        _positive("secagg-num-shares", self.secagg_num_shares)
        if self.secagg_num_shares > 1 and self.secagg_num_shares < 3:
            raise ConfigError(
                "secagg-num-shares", self.secagg_num_shares, "as a count must be >= 3"
            )
        _positive("secagg-threshold", self.secagg_threshold)
        if self.secagg_num_shares > 1 and self.secagg_threshold >= self.secagg_num_shares:
            raise ConfigError(
                "secagg-threshold", self.secagg_threshold, "must be below secagg-num-shares"
            )
        _positive("secagg-clipping-range", self.secagg_clipping_range)
        _positive("secagg-max-weight", self.secagg_max_weight)
        if not 1 < self.secagg_quantization_range <= MODULUS_RANGE // 1024:
            raise ConfigError(
                "secagg-quantization-range",
                self.secagg_quantization_range,
                f"must lie in (1, {MODULUS_RANGE // 1024}] so the sum of up to 1,023 clients' "
                "values stays below the masks' 2**32 modulus",
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
        from fedfm_flower.data.registry import dataset_spec
        from fedfm_flower.tasks import task_has_validation

        _one_of("evaluation-split", self.evaluation_split, EVALUATION_SPLITS)
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
        from fedfm_flower.data.registry import dataset_spec
        from fedfm_flower.tasks import task_modality

        task = dataset_spec(self.dataset).task
        family = family_of(self.backbone)
        if family.name != "vit" and trains_backbone(self):
            raise ConfigError(
                "train-backbone",
                True,
                f"backbone '{self.backbone}' (family '{family.name}') is tuned with adapters "
                f"only; method '{self.method}' and train-backbone need a ViT",
            )
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


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, f"allowed: {', '.join(allowed)}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(key, value, "must be > 0")
