"""The typed, validated experiment configuration, parsed once from Flower's run config.

Every key lives, with its default, under ``[tool.flwr.app.config]`` in ``pyproject.toml``
(kebab-case, because Flower rejects overrides of keys that are not declared there). The
dataclass fields are the snake_case twins of those keys. ``ExperimentConfig.from_run_config``
checks every value and fails at start with an error that names the key, the value and what
is allowed, so a typo never surfaces twenty minutes into a run.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfm_flower.registry import METHODS as METHOD_REGISTRY

# Names the config accepts. Registries elsewhere (methods, datasets, backbones) must agree
# with these tuples; tests check that they do.
METHODS: tuple[str, ...] = tuple(METHOD_REGISTRY)
DATASETS: tuple[str, ...] = (
    "digits",
    "digits-domains",
    "cifar100",
    "tiny-imagenet",
    "domainnet",
    "office-caltech10",
    "omniglot",
)
BACKBONES: tuple[str, ...] = (
    "tiny-vit",
    "vit_tiny_patch16_224",
    "vit_small_patch16_224",
    "vit_base_patch16_224",
)
PARTITIONERS: tuple[str, ...] = ("iid", "dirichlet", "pathological", "natural-id")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
SEQ_LEARNERS: tuple[str, ...] = ("mamba", "lstm", "mlp")  # fedfm_flower.learners.sequence
SCAN_BACKENDS: tuple[str, ...] = ("auto", "torch", "cuda")  # ...learners.selective_scan
SEQ_INPUT_SCALES: tuple[str, ...] = ("none", "rms", "rms-rescale")  # ...learners.pfedseq
SEQ_LEARNER_UPDATES: tuple[str, ...] = ("full-batch", "mini-batch")  # ...learners.pfedseq
SEQ_OUTPUT_INITS: tuple[str, ...] = ("zero", "reference")  # ...learners.sequence
PROMPT_GENERATORS: tuple[str, ...] = ("cross-attention", "basis", "mlp", "adain")  # learners.pfedpg
PROMPT_QUERIES: tuple[str, ...] = ("per-prompt", "single")


class ConfigError(ValueError):
    """A run-config value that is not allowed; the message names key, value and rule."""

    def __init__(self, key: str, value: Any, allowed: str, source: str = "run config") -> None:
        super().__init__(f"{source} '{key}' = {value!r} is invalid: {allowed}")
        self.key = key
        self.value = value


@dataclass(frozen=True)
class ExperimentConfig:
    """All settings of one experiment; field ``foo_bar`` is run-config key ``foo-bar``."""

    # federation
    method: str = "pfedseq"
    num_server_rounds: int = 20
    num_clients: int = 0  # 0: take it from the node config's num-partitions
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_train_clients: int = 1
    eval_every: int = 1
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
    public_fraction: float = 0.3
    image_size: int = 16
    # model
    backbone: str = "tiny-vit"
    pretrained: bool = True
    weights_file: str = ""
    cache_dir: str = ""
    pretrain_epochs: int = 40
    lora_rank: int = 4
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    lora_target_modules: str = "qkv"
    # local training
    local_epochs: int = 1
    local_steps: int = 0  # >0 replaces epochs by a fixed number of optimizer steps
    head_epochs: int = 1  # fedrep: head epochs before the adapter epochs
    finetune_epochs: int = 1  # fedavg-ft: local fine-tuning epochs before evaluation
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 0.0
    device: str = "auto"
    # pfedseq: the server's sequential learner (docs/methods/pfedseq.md)
    pfedseq_seq_len: int = 10
    pfedseq_warmup_rounds: int = 10
    pfedseq_lr: float = 0.001
    pfedseq_learner: str = "mamba"
    pfedseq_num_layers: int = 2
    pfedseq_state_dim: int = 16
    pfedseq_expand: int = 2
    pfedseq_conv_kernel: int = 4
    pfedseq_mlp_hidden: int = 100
    pfedseq_cross_client: bool = True
    pfedseq_global_aggregation: bool = True
    pfedseq_input_scale: str = "none"
    pfedseq_output_init: str = "zero"
    pfedseq_learner_update: str = "full-batch"
    pfedseq_batch_rows: int = 32
    pfedseq_chunk_size: int = 0
    pfedseq_scan_backend: str = "auto"
    # visual prompts (fedvpt, fedvpt-deep, pfedpg) and pfedpg's generator (docs/methods/pfedpg.md)
    vpt_num_prompts: int = 10
    pfedpg_lr: float = 0.001
    pfedpg_generator: str = "cross-attention"
    pfedpg_query: str = "per-prompt"
    pfedpg_attention_dim: int = 0  # l_k = l_v of the cross-attention; 0: the prompt width
    pfedpg_hidden: int = 100  # hidden width of the mlp generator
    # outputs and state
    output_dir: str = "runs"
    run_name: str = ""
    resume: bool = False
    keep_checkpoints: int = 2
    client_state_dir: str = ""

    @staticmethod
    def keys() -> tuple[str, ...]:
        """All run-config keys (kebab-case) this config understands."""
        return tuple(f.name.replace("_", "-") for f in dataclasses.fields(ExperimentConfig))

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> ExperimentConfig:
        """Parse and validate Flower's run config; unknown keys are an error too."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in run_config.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(key, raw, f"unknown key; known keys: {', '.join(cls.keys())}")
            values[name] = _coerce(key, raw, type(getattr(cls(), name)))
        config = cls(**values)
        config.validate()
        return config

    def to_run_config(self) -> dict[str, Any]:
        """The kebab-case mapping Flower would pass for this config."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> ExperimentConfig:
        """A validated copy with some fields changed (snake_case names)."""
        config = dataclasses.replace(self, **changes)
        config.validate()
        return config

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid value."""
        _one_of("method", self.method, METHODS)
        _one_of("dataset", self.dataset, DATASETS)
        _one_of("backbone", self.backbone, BACKBONES)
        _one_of("partitioner", self.partitioner, PARTITIONERS)
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        _one_of("device", self.device, DEVICES)
        _one_of("pfedseq-learner", self.pfedseq_learner, SEQ_LEARNERS)
        _one_of("pfedseq-scan-backend", self.pfedseq_scan_backend, SCAN_BACKENDS)
        _one_of("pfedseq-input-scale", self.pfedseq_input_scale, SEQ_INPUT_SCALES)
        _one_of("pfedseq-output-init", self.pfedseq_output_init, SEQ_OUTPUT_INITS)
        _one_of("pfedseq-learner-update", self.pfedseq_learner_update, SEQ_LEARNER_UPDATES)
        _one_of("pfedpg-generator", self.pfedpg_generator, PROMPT_GENERATORS)
        _one_of("pfedpg-query", self.pfedpg_query, PROMPT_QUERIES)
        _positive("vpt-num-prompts", self.vpt_num_prompts)
        _positive("pfedpg-lr", self.pfedpg_lr)
        _positive("pfedpg-hidden", self.pfedpg_hidden)
        for key, value in (
            ("pfedseq-seq-len", self.pfedseq_seq_len),
            ("pfedseq-lr", self.pfedseq_lr),
            ("pfedseq-num-layers", self.pfedseq_num_layers),
            ("pfedseq-state-dim", self.pfedseq_state_dim),
            ("pfedseq-expand", self.pfedseq_expand),
            ("pfedseq-mlp-hidden", self.pfedseq_mlp_hidden),
            ("pfedseq-batch-rows", self.pfedseq_batch_rows),
        ):
            _positive(key, value)
        if not 2 <= self.pfedseq_conv_kernel <= 4:
            raise ConfigError(
                "pfedseq-conv-kernel",
                self.pfedseq_conv_kernel,
                "must lie in [2, 4] (the causal-conv1d kernel's range; the paper uses 4)",
            )
        _positive("num-server-rounds", self.num_server_rounds)
        _positive("eval-every", self.eval_every)
        _positive("image-size", self.image_size)
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
            ("pretrain-epochs", self.pretrain_epochs),
            ("momentum", self.momentum),
            ("weight-decay", self.weight_decay),
            ("pfedseq-warmup-rounds", self.pfedseq_warmup_rounds),
            ("pfedseq-chunk-size", self.pfedseq_chunk_size),
            ("pfedpg-attention-dim", self.pfedpg_attention_dim),
        ):
            if value < 0:
                raise ConfigError(key, value, "must be >= 0")
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
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError("lora-dropout", self.lora_dropout, "must lie in [0, 1)")
        if not self.target_modules:
            raise ConfigError(
                "lora-target-modules", self.lora_target_modules, "name at least one module"
            )
        if self.weights_file and not Path(self.weights_file).expanduser().is_file():
            raise ConfigError("weights-file", self.weights_file, "no such file")
        if self.data_dir and not Path(self.data_dir).expanduser().is_dir():
            raise ConfigError("data-dir", self.data_dir, "no such directory")
        if self.partitioner == "natural-id" and not self.natural_id_column:
            from fedfm_flower.data.registry import dataset_spec

            if not dataset_spec(self.dataset).natural_id_column:
                raise ConfigError(
                    "partitioner",
                    self.partitioner,
                    f"dataset '{self.dataset}' has no natural ids; set natural-id-column",
                )
        if self.resume and not self.run_name:
            raise ConfigError("resume", True, "needs 'run-name' naming the run to resume")

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
        partition_id = _coerce("partition-id", pid_raw, int)
        client_id = _coerce("client-id", node_config.get("client-id", partition_id), int)
        num_raw = node_config.get("num-partitions", experiment.num_clients)
        num_partitions = _coerce("num-partitions", num_raw, int)
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


def _coerce(key: str, raw: Any, kind: type) -> Any:
    """Convert a TOML/CLI value to the field's type, or fail naming the key."""
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.lower() in ("true", "false"):
                return raw.lower() == "true"
            raise ValueError
        if kind is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if kind is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if kind is str:
            return str(raw)
    except (TypeError, ValueError):
        pass
    raise ConfigError(key, raw, f"expected a value of type {kind.__name__}")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, f"allowed: {', '.join(allowed)}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(key, value, "must be > 0")
