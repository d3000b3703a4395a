"""The common run-config keys, declared once, in groups by concern.

Each group is a frozen dataclass whose fields are run-config keys (field ``num_server_rounds``
is key ``num-server-rounds``), each declared with ``setting(...)``: its type, default, the rules
its value must satisfy and a one-line ``doc``. ``ExperimentConfig`` inherits every group, so
``config.lora_rank`` reads a field of ``LoraKeys``; the tuners' keys are declared beside the
tuners (``fedfm_flower.models.tuners.keys``), a method's own keys in its method module.
``pyproject.toml``'s ``[tool.flwr.app.config]`` and docs/configuration.md's key tables are
generated from these declarations (``python -m fedfm_flower.config.schema --write``).

Allowed values that come from a registry are functions, read when a value is checked. Like the
config, this module imports neither torch nor flwr.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.data.registry import DATASETS
from fedfm_flower.methods.registry import METHODS
from fedfm_flower.methods.settings import setting
from fedfm_flower.models.families import BACKBONES
from fedfm_flower.privacy.support import DP_MODES

PARTITIONERS: tuple[str, ...] = (
    "iid",
    "dirichlet",
    "pathological",
    "disjoint",
    "natural-id",
    "domain-dirichlet",
)
NATURAL_ID_PARTITIONERS: tuple[str, ...] = ("natural-id", "domain-dirichlet")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")
EVALUATION_SPLITS: tuple[str, ...] = ("test", "val")  # the split every evaluation reads
WANDB_MODES: tuple[str, ...] = ("online", "offline")  # fedfm_flower.records.trackers.wandb
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
MODEL_DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")  # hf-causal-lm only
DEVICE_MAPS: tuple[str, ...] = ("", "auto")  # hf-causal-lm only; "" loads on one device
# TAP's model's backbone (fedfm_flower.models.multimodal): MoME/MoTE experts, or shared layers only
MM_BACKBONE_ROUTINGS: tuple[str, ...] = ("experts", "shared")
# SecAgg+'s masks live below a 2**32 modulus (fedfm_flower.privacy.secagg.MODULUS_RANGE): with
# 2**22 levels, the sum of up to 1,023 clients' values stays below it (a test checks this).
QUANTIZATION_LEVELS = 2**22
QUANTIZATION_NOTE = "so the sum of up to 1,023 clients' values stays below the masks' 2**32 modulus"


def method_names() -> tuple[str, ...]:
    """The registered methods (``fedfm_flower.methods.registry``)."""

    return tuple(METHODS)


def dataset_names() -> tuple[str, ...]:
    """The registered datasets (``fedfm_flower.data.registry``)."""

    return tuple(DATASETS)


def backbone_names() -> tuple[str, ...]:
    """The backbones of every model family (``fedfm_flower.models.families``)."""

    return BACKBONES


def dp_modes() -> tuple[str, ...]:
    """The differential-privacy modes (``fedfm_flower.privacy.support``)."""

    return DP_MODES


@dataclass(frozen=True)
class FederationKeys:
    """Which method runs, over how many rounds and clients, sampled how."""

    group: ClassVar[str] = "federation"
    title: ClassVar[str] = "Federation"

    method: str = setting(
        "pfedseq",
        choices=method_names,
        doc=(
            "`local`, `fedavg`, `fedrep`, `fedavg-ft`, `fedvpt`, `fedvpt-deep`, `pfedseq`, "
            "`pfedpg` (see the README's method table, "
            "[`docs/methods/pfedseq.md`](methods/pfedseq.md) and "
            "[`docs/methods/pfedpg.md`](methods/pfedpg.md)); `fedvpt`, `fedvpt-deep` and `pfedpg` "
            "tune visual prompts instead of LoRA, so they ignore the `lora-*` keys"
        ),
    )
    num_server_rounds: int = setting(20, positive=True, doc="communication rounds (> 0)")
    num_clients: int = setting(
        0,
        non_negative=True,
        doc=(
            "number of clients/partitions; `0` takes it from the node config's `num-partitions` "
            "(simulation sets it; in a deployment, the value most nodes report). The ServerApp "
            "waits for this many nodes before round 1. `pfedseq` sizes its learners by it (one "
            "channel per client, ids 0..N-1), `pfedpg`, `pfedhn` and `pefll` their descriptors, "
            "`pfedla` its hypernetworks and `apple` its cores (one per client, ids 0..N-1)"
        ),
    )
    fraction_train: float = setting(
        1.0,
        within=(0, 1),
        bounds="(]",
        doc=(
            "fraction of connected clients sampled for training each round, in (0, 1]; seeded, so "
            "the same seed samples the same clients"
        ),
    )
    fraction_evaluate: float = setting(
        1.0, within=(0, 1), bounds="(]", doc="fraction sampled for evaluation, in (0, 1]"
    )
    min_train_clients: int = setting(1, positive=True, doc="lower bound on the number sampled")
    sample_per_task: bool = setting(
        False,
        doc=(
            "training samples `fraction-train` of each client task's clients (at least one per "
            "task) instead of all clients at once, where the task names the clients' tasks "
            "(`instructions`, `flan`): FedDPA's 40-client setting (1-5 of each task's 5 clients). "
            "`min-train-clients` does not apply"
        ),
    )
    eval_every: int = setting(
        1, positive=True, doc="evaluate every this many rounds (and always after the last)"
    )
    fused_evaluation: bool = setting(
        True,
        doc=(
            "one phase of messages per round instead of two: round t's evaluation rides on round "
            "t+1's training messages. A client sampled for both evaluates first, on the tensors "
            "round t's evaluate message would have carried, with its client state as of round t "
            "and round t's seeds, then trains, and replies once (`evaluate-metrics` beside the "
            "training reply; an error in one part is reported in the reply and leaves the other "
            "standing). A client due the evaluation but not sampled to train gets round t's "
            "evaluate message in round t+1's phase; the last round (federated or post-training) "
            "is evaluated in a phase of its own, as is a round whose training had no usable "
            "reply. Results (`metrics.jsonl`'s per-round evaluation, still attributed to round t, "
            "the per-client metrics, the summary) are bit-identical to `false`; `bytes-down` is "
            "lower (the payload travels once) and round t's evaluation time is part of round "
            "t+1's `round-seconds`. Round t's line is written when its training is aggregated and "
            "rewritten when its evaluation arrives; its checkpoint is marked "
            "`evaluation-pending`, so `resume=true` after a crash evaluates round t again. "
            "`round-timeout` covers evaluation and training of a fused round together. A method "
            "whose evaluation payload is not its next training payload evaluates in a phase of "
            "its own whatever this says (`PersonalizedStrategy.fuses_evaluation`; every method "
            "here fuses). `false`: the two-phase loop (train, then evaluate)"
        ),
    )
    prompt_replies: bool = setting(
        True,
        doc=(
            "the ServerApp pulls replies with pauses of 0.01 s growing to 0.1 s "
            "(`server_apps/polling.py`). `false`: Flower's own `send_and_receive`, which in "
            "deployment (`HttpGrid`) sleeps 3 s between pulls, so each phase waits up to 3 s "
            "after its last reply. Results are the same either way"
        ),
    )
    round_timeout: float = setting(
        600.0,
        positive=True,
        doc=(
            "seconds to wait for replies; late or missing clients are logged as missing and the "
            "round completes with the others"
        ),
    )
    max_failed_rounds: int = setting(
        0,
        non_negative=True,
        doc=(
            "consecutive failed rounds the run tolerates (>= 0); a round fails when no client "
            "returns a usable training reply or, when evaluation is due, no usable evaluation "
            "reply. One more stops the run with the reasons (`RunFailed`; the launchers exit 1); "
            "the failing round is recorded in `metrics.jsonl` but not checkpointed, so "
            "`resume=true` repeats it. With `fused-evaluation`, a round whose evaluation fails is "
            "known one phase later, after its checkpoint: its line is rewritten with `failed`, "
            "and `resume=true` repeats its evaluation. A last round without a usable evaluation "
            "always fails the run"
        ),
    )
    seed: int = setting(
        0,
        doc=(
            "seeds partitioning, model initialisation, client sampling and every client's local "
            "training; not the DP noise, which is fresh OS entropy (a DP run is reproducible "
            "except for its noise)"
        ),
    )
    data_seed: int = setting(
        -1,
        within=(-1, 2**31 - 1),
        doc=(
            "seeds the data alone (the public hold-out, the partition, each client's test and "
            "validation split, a synthetic corpus) and the offline foundation models pretrained "
            "on it (`tiny-vit`, `small-vit`, `offline-vit-s`, `tiny-llama`: a checkpoint every "
            "run of one federation shares); `-1`: `seed`. The tuning command's final "
            "runs set it to the tuning seed, so every seed tests on data the trials never "
            "validated on"
        ),
    )


@dataclass(frozen=True)
class DataKeys:
    """Which dataset, split how over the clients and into train/validation/test."""

    group: ClassVar[str] = "data"
    title: ClassVar[str] = "Data"

    dataset: str = setting(
        "digits",
        choices=dataset_names,
        doc=(
            "`digits` (offline, label skew), `digits-domains` (offline, feature skew: one image "
            "domain per client), `glyph-domains` (offline benchmark: digits in six DomainNet-like "
            "styles with a fixed public split, generated and cached on first use; "
            "[`docs/benchmark.md`](benchmark.md)), `cifar10`, `cifar100`, `tiny-imagenet`, "
            "`domainnet`, `office-caltech10`, `dermoscopic-fl`, `omniglot`, `office-home`, "
            "`organamnist` (image classification; the last two are FedPerfix's, "
            "[below](#fedperfixs-datasets)); `instructions` "
            "(offline instruction following: 8 instruction tasks, one per client in turn; needs a "
            "text backbone), `flan` (FedDPA's federated Flan datasets from `data-dir`, "
            "[below](#feddpas-flan-datasets)); `multitask` (offline, TAP's multi-modal multi-task "
            "setting: image classification, image reconstruction and VQA on glyph-domains images, "
            "text classification and generation from the instruction corpus, in 3 client groups "
            "with different modality-task pairs; `fedfm_flower/data/multitask.py`; needs a "
            "multi-modal backbone). The dataset decides the task "
            "([`docs/architecture.md`](architecture.md))"
        ),
    )
    data_dir: str = setting(
        "",
        doc=(
            "local copy of a paper dataset (a `save_to_disk` directory or an image folder; for "
            "`organamnist` the folder holding `organamnist.npz` or the `.npz` itself; for `flan` "
            "the folder of per-client JSON files or a Hub dataset id); empty loads by Hub name "
            "(needs internet)"
        ),
    )
    partitioner: str = setting(
        "dirichlet",
        choices=PARTITIONERS,
        doc=(
            "`iid`, `dirichlet` (label skew with `dirichlet-alpha`), `pathological` "
            "(`classes-per-client` classes each, which may overlap between clients), `disjoint` "
            "(`classes-per-client` classes of its own per client, all their samples; needs "
            "clients x classes-per-client <= classes), `natural-id` (one client per "
            "domain/writer), "
            "`domain-dirichlet` (client `p` gets domain `p mod D` of the sorted natural ids, and "
            "each domain is split over its clients with Dirichlet(`dirichlet-alpha`) label skew; "
            "needs at least one client per domain)"
        ),
    )
    dirichlet_alpha: float = setting(
        0.3,
        positive=True,
        doc="concentration of the Dirichlet label skew (> 0; smaller is more skewed)",
    )
    classes_per_client: int = setting(
        2, positive=True, doc="classes per client for `pathological` and `disjoint`"
    )
    natural_id_column: str = setting(
        "",
        doc=(
            "column that `natural-id` and `domain-dirichlet` partition by; empty uses the "
            "dataset's own (e.g. `domain`)"
        ),
    )
    min_train_examples: int = setting(
        10,
        positive=True,
        doc=(
            "smallest training split a client may hold (> 0); a smaller one fails the run at "
            "start, naming the client, its counts and the settings to change. Partitions are "
            "never redrawn silently"
        ),
    )
    min_test_examples: int = setting(
        5,
        positive=True,
        doc=(
            "smallest test split a client may hold (> 0); every client's accuracy counts equally "
            "in the reported mean, so a client with 1 test example would weigh as much as one "
            "with 100"
        ),
    )
    test_fraction: float = setting(
        0.2,
        within=(0, 1),
        bounds="()",
        doc="share of each client's data held out as its test split, in (0, 1)",
    )
    val_fraction: float = setting(
        0.0,
        doc=(
            "share of each client's examples held out for validation, drawn out of its training "
            "examples (like `test-fraction`, a share of all of them; val + test < 1). "
            "`fedfm_flower.tune --val-fraction` takes a share of the training examples instead "
            "and converts"
        ),
    )
    evaluation_split: str = setting(
        "test",
        choices=EVALUATION_SPLITS,
        doc=(
            "the split every evaluation reads: `test`, or `val` (needs `val-fraction` > 0; every "
            "task has a validation split). With `val` the client never touches its test split, "
            "the run's `test-*` metrics are the validation split's, and reports leave the run out "
            "of their tables (tuning trials, `fedfm_flower.tune`)"
        ),
    )
    public_fraction: float = setting(
        0.3,
        within=(0, 1),
        bounds="()",
        doc=(
            "share of the whole dataset held out *before* partitioning as the public split the "
            "offline foundation model is pretrained on; no client holds any of it. Not used by "
            "`glyph-domains`, whose public split is fixed by the dataset"
        ),
    )
    multitask_style_skew: bool = setting(
        False,
        doc=(
            '`dataset = "multitask"` only: each image pair\'s images stay grouped by glyph style, '
            "so its holders' shares each come from one style (the first half of `image-cls`'s "
            "holders paint, the second half sketch; `vqa`'s six styles spread over its holders). "
            "`false`: styles mixed, every holder's share alike"
        ),
    )
    image_size: int = setting(
        16, positive=True, doc="images are resized to this square size (224 for the timm ViTs)"
    )
    max_length: int = setting(
        96,
        positive=True,
        doc="text tasks: tokens per training example (prompt + response; longer ones are cut)",
    )
    max_new_tokens: int = setting(
        16,
        positive=True,
        doc="text tasks: most tokens generated per test prompt (greedy) before ROUGE",
    )
    test_time_evaluation: bool = setting(
        False,
        doc=(
            "text tasks: each client also answers every other task's test examples with its own "
            "model and reports `ttp-rouge-1/2/l`, the mean over all tasks, its own included "
            "(FedDPA's test-time personalization). Costs one generation pass per task"
        ),
    )
    unseen_test_dir: str = setting(
        "",
        doc=(
            "text tasks, with `test-time-evaluation`: a directory of `flan`-format test files "
            "(`*.json`/`*.jsonl`) of tasks outside the federation (FedDPA's Table 14); each "
            "client also answers them with its own model and reports `unseen-<task>-rouge-1/2/l` "
            "per file's task (its records' most common `category`, else the file name; files of "
            "one task pool), outside `ttp-*`. Empty: none"
        ),
    )
    unseen_tasks: str = setting(
        "",
        doc=(
            "`instructions` with `test-time-evaluation`: comma-separated offline tasks no client "
            "holds (fewer than 8 clients) answered as `unseen-test-dir`'s, each the test split "
            "its client would have in the 8-client federation. Empty: none"
        ),
    )


@dataclass(frozen=True)
class ModelKeys:
    """The frozen backbone: which, from where, in which dtype and placement."""

    group: ClassVar[str] = "model"
    title: ClassVar[str] = "Model"

    backbone: str = setting(
        "tiny-vit",
        choices=backbone_names,
        doc=(
            "image family `vit`: `tiny-vit` (CPU, offline foundation model of the digits setups), "
            "`small-vit` (6 blocks, width 128, convolutional stem, 0.85 M parameters: the offline "
            "foundation model of the `glyph-domains` benchmark), `offline-vit-s` (ViT-S/16's "
            "shape with the stem, 22.8 M parameters: the same offline pretraining on a GPU), "
            "`vit_tiny_patch16_224`, `vit_small_patch16_224`, `vit_base_patch16_224`; image "
            "family `resnet` (trained whole, tuner `none`): `tiny-resnet` (CPU, offline, beside "
            "`tiny-vit`), `small-resnet` (basic blocks, widths 28-224, 0.96 M parameters, "
            "offline, beside `small-vit`), `resnet18`, `resnet50` (timm); text family "
            "`causal-lm`: `tiny-llama` (offline foundation model: a LLaMA-architecture model "
            "pretrained on the public split of `instructions`, cached like `tiny-vit`), "
            "`hf-causal-lm` (`model-name-or-path`); multi-modal families `multimodal`: "
            "`mm-offline` (TAP's model built from `small-vit` and `tiny-llama`) and "
            "`multimodal-hf`: `mm-flava`, `mm-vilt` (the same model from a FLAVA or ViLT "
            "checkpoint at `model-name-or-path`; [`docs/methods/tap.md`](methods/tap.md)). Its "
            "family's modality must be the dataset's task's"
        ),
    )
    pretrained: bool = setting(
        True,
        doc=(
            "load pretrained weights: for `tiny-vit`, `small-vit`, `offline-vit-s` the cached "
            "offline foundation model (built on first use), for timm ViTs `weights-file` or the "
            "Hub"
        ),
    )
    weights_file: str = setting(
        "",
        doc=(
            "local weights file (timm ViTs: any file timm reads; `tiny-vit`, `small-vit`, "
            "`offline-vit-s`: safetensors); must exist"
        ),
    )
    cache_dir: str = setting(
        "",
        doc=(
            "cache for the offline foundation model, the clients' partition plans (so a "
            "ClientApp started per message skips partitioning and its imports) and the models' "
            "initial trainable tensors (so the ServerApp of a later run of the same model builds "
            "no model); empty is "
            "`$XDG_CACHE_HOME/fedfm-flower`, i.e. `~/.cache/fedfm-flower` by default"
        ),
    )
    model_name_or_path: str = setting(
        "",
        doc=(
            "`hf-causal-lm`: a Hugging Face causal LM name (needs the Hub or its local cache) or "
            "a directory written by `save_pretrained`"
        ),
    )
    model_dtype: str = setting(
        "auto",
        choices=MODEL_DTYPES,
        doc=(
            "`hf-causal-lm` only: dtype of the loaded weights, `auto`, `float32`, `float16`, "
            '`bfloat16`. `auto` is `float32` when the model runs on the CPU (`device = "cpu"` or '
            "no CUDA) and the checkpoint's own dtype (transformers' `dtype=\"auto\"`, e.g. float16 "
            "for LLaMA-7B) when CUDA runs it. Adapters stay float32 whatever the backbone's "
            "dtype. Set it explicitly when nodes differ (CPU server, GPU clients) so that all "
            "build the same initial adapter"
        ),
    )
    device_map: str = setting(
        "",
        choices=DEVICE_MAPS,
        doc=(
            '`hf-causal-lm` only: `""` loads the model whole and moves it to `device`; `auto` '
            'passes `device_map="auto"` to transformers, which places it over the GPUs (then CPU) '
            "itself and is never moved afterwards. Needs the `accelerate` package (checked at "
            'start); not with `device = "cpu"`'
        ),
    )
    load_in_4bit: bool = setting(
        False,
        doc=(
            "`hf-causal-lm` only: load the weights in 4 bits (NF4 with double quantization, "
            "QLoRA's; computing in `model-dtype`, `auto` being bfloat16 where supported, else "
            "float16) on the GPU. Needs `bitsandbytes` (checked at start, on every node) and CUDA "
            "(checked when the model loads); the model is not moved afterwards"
        ),
    )
    pretrain_epochs: int = setting(
        40,
        non_negative=True,
        doc=(
            "epochs of foundation pretraining on the public split (`tiny-vit`, `small-vit`, "
            "`offline-vit-s`, `tiny-resnet`, `small-resnet`, `tiny-llama`)"
        ),
    )
    train_backbone: bool = setting(
        False,
        doc=(
            "the ViT's or ResNet's own weights train and are shared or kept by their groups "
            "(`vit.*`, `resnet.*`; a BatchNorm's running statistics go with its weight); always "
            "on for `fedperfix`, `fedbabu`, `apfl`, `per-fedavg`, `per-fedavg-ft` on a ViT or a "
            "ResNet"
        ),
    )
    mm_backbone_routing: str = setting(
        "experts",
        choices=MM_BACKBONE_ROUTINGS,
        doc=(
            "multi-modal backbones only: `experts`, TAP's modality and task layers of experts "
            "beside the shared layers; `shared`, a standard transformer backbone: every token "
            "goes through the shared layers only, so every client holds the same backbone "
            "components and FedAvg of them is vanilla FedAvg (TAP's Tables 14-16 baselines; not "
            "with `tap`). [`docs/methods/tap.md`](methods/tap.md)"
        ),
    )


@dataclass(frozen=True)
class TrainingKeys:
    """How each client trains in a round (and fine-tunes before evaluating)."""

    group: ClassVar[str] = "training"
    title: ClassVar[str] = "Local training"

    local_epochs: int = setting(1, non_negative=True, doc="local epochs per round")
    local_steps: int = setting(
        0,
        non_negative=True,
        doc=(
            "if > 0, a fixed number of optimizer steps instead of epochs (a reply still weighs by "
            "the client's data size)"
        ),
    )
    head_epochs: int = setting(
        1,
        non_negative=True,
        doc="`fedrep`: epochs on the head (adapter fixed) before the adapter epochs",
    )
    finetune_epochs: int = setting(
        1,
        non_negative=True,
        doc=(
            "`fedavg-ft`, `per-fedavg-ft`: fine-tuning epochs before each evaluation; `fedbabu`: "
            "epochs of head fine-tuning (body fixed) before each evaluation"
        ),
    )
    finetune_steps: int = setting(
        0,
        non_negative=True,
        doc="> 0: that many fine-tuning batches instead of `finetune-epochs` (TAP's post-train P)",
    )
    batch_size: int = setting(32, positive=True, doc="mini-batch size")
    optimizer: str = setting("sgd", choices=OPTIMIZERS, doc="`sgd`, `adam`, `adamw`")
    lr: float = setting(
        0.02,
        positive=True,
        doc="learning rate (0.05 with momentum 0.9 diverged for FedRep on 2 clients)",
    )
    momentum: float = setting(0.9, non_negative=True, doc="SGD momentum")
    weight_decay: float = setting(0.0, non_negative=True, doc="weight decay")
    device: str = setting(
        "auto",
        choices=DEVICES,
        doc=(
            "`auto` (CUDA when available), `cpu`, `cuda`; also where the `pfedseq` server runs "
            "its learners and the `pfedpg` server its generator"
        ),
    )


@dataclass(frozen=True)
class OutputKeys:
    """Where a run writes, how it is named in reports, checkpoints and resuming."""

    group: ClassVar[str] = "outputs"
    title: ClassVar[str] = "Outputs and state"

    output_dir: str = setting(
        "runs", doc="parent of the run directories (relative to the ServerApp's working directory)"
    )
    run_name: str = setting(
        "",
        doc=(
            "run directory name; empty makes `<method>-<dataset>-s<seed>-<UTC time>`. An existing "
            "run with results is never overwritten"
        ),
    )
    label: str = setting(
        "",
        doc=(
            "the method's name in reports, e.g. `pfedpg:basis-only` (the sweep sets it); empty is "
            "`method`. Changes nothing in the run"
        ),
    )
    setup: str = setting(
        "",
        doc=(
            "the setup's name in reports, e.g. `glyphs-feature-skew` (the sweep sets it); empty "
            "is `dataset`. Changes nothing in the run"
        ),
    )
    resume: bool = setting(
        False,
        doc=(
            "continue `run-name` from its newest intact checkpoint (a damaged one is skipped with "
            "a warning naming the file); refused when the foundation model to load is another "
            "than the run recorded"
        ),
    )
    keep_checkpoints: int = setting(
        2,
        positive=True,
        doc=(
            "server checkpoints kept; clients keep one round of personal state more, so a resume "
            "that falls back past a damaged checkpoint still finds the client state it needs"
        ),
    )
    client_state_dir: str = setting(
        "",
        doc=(
            "where clients mirror their personal state in simulation (a node config's `state-dir` "
            "wins); needed for `resume` of methods with client-local state (`local`, `fedrep`, "
            "and the heads of `pfedseq`, `pfedpg`, `fedvpt`, `fedvpt-deep`)"
        ),
    )


@dataclass(frozen=True)
class TrackerKeys:
    """Optional metric trackers besides the run directory (fedfm_flower/trackers)."""

    group: ClassVar[str] = "trackers"
    title: ClassVar[str] = "Trackers"

    tensorboard: bool = setting(
        False,
        doc=(
            "also write each round's numeric metrics as TensorBoard scalars to "
            "`<run-dir>/tensorboard` (`tensorboard --logdir runs`), and the summary's as "
            "`summary/<key>`; local files, no account"
        ),
    )
    wandb: bool = setting(
        False,
        doc=(
            "also log to Weights & Biases (`pip install -e .[wandb]`): the run config as the W&B "
            "config, each round's numeric metrics at step = round, the summary into the W&B "
            "summary; one W&B run per run directory (its id is derived from the path, so `resume` "
            "continues it)"
        ),
    )
    wandb_project: str = setting("fedfm-flower", doc="the W&B project")
    wandb_entity: str = setting(
        "", doc="the W&B entity (team or user); empty: the account's default"
    )
    wandb_mode: str = setting(
        "online",
        choices=WANDB_MODES,
        doc=(
            "`online` (needs `wandb login` or `WANDB_API_KEY`) or `offline` (files under "
            "`<run-dir>/wandb`, no network; upload later with `wandb sync`)"
        ),
    )
    mlflow: bool = setting(
        False,
        doc=(
            "also log to MLflow (`pip install -e .[mlflow]`): the run config as parameters, each "
            "round's numeric metrics at step = round, the summary as `summary-<key>` metrics and "
            "the artifact `summary.json`; one MLflow run per run directory (tagged with its path, "
            "so `resume` continues it)"
        ),
    )
    mlflow_tracking_uri: str = setting(
        "",
        doc=(
            "where MLflow stores runs; empty: a SQLite store `<output-dir>/mlflow.db` with "
            "artifacts under `<output-dir>/mlartifacts` (`mlflow ui --backend-store-uri "
            "sqlite:///runs/mlflow.db`)"
        ),
    )
    mlflow_experiment: str = setting("fedfm-flower", doc="the MLflow experiment")


@dataclass(frozen=True)
class PrivacyKeys:
    """Differential privacy of the shared updates (fedfm_flower/privacy)."""

    group: ClassVar[str] = "privacy"
    title: ClassVar[str] = "Differential privacy"

    dp: str = setting(
        "none",
        choices=dp_modes,
        doc=(
            "differential privacy of the shared updates ([docs/privacy.md](privacy.md)): "
            "`central` (each client clips its update to `dp-clipping-norm`; the server averages "
            "with equal weights over the sampled clients and adds Gaussian noise: DP-FedAvg), "
            "`local` (each client clips its update and adds the noise itself before sending); a "
            "method that cannot take the mode is refused at start with the reason. Needs Opacus "
            "(`pip install -e .[dp]`)"
        ),
    )
    dp_clipping_norm: float = setting(
        1.0,
        positive=True,
        doc="C: the L2 bound of one client's update of all its shared tensors together (> 0)",
    )
    dp_noise_multiplier: float = setting(
        1.0,
        non_negative=True,
        doc=(
            "sigma: the noise's standard deviation in units of C, on the sum of the clipped "
            "updates (`central`: the average gets sigma C / m for m sampled clients; sensitivity "
            "C) or on each client's update (`local`: sigma C; sensitivity 2C, so epsilon is that "
            "of sigma / 2) (>= 0; 0 reports epsilon = inf). The noise is fresh OS entropy per "
            "release, not derived from `seed` ([why](privacy.md#the-noise-no-one-can-regenerate))"
        ),
    )
    dp_delta: float = setting(
        1e-05,
        within=(0, 1),
        bounds="()",
        doc=(
            "delta of the client-level (epsilon, delta) reported each round as `dp-epsilon` (in "
            "(0, 1))"
        ),
    )
    dp_target_epsilon: float = setting(
        0.0,
        non_negative=True,
        doc=(
            "> 0: instead of `dp-noise-multiplier`, the sigma whose `num-server-rounds` releases "
            "spend this epsilon at `dp-delta` and the mode's sensitivity (Opacus' "
            "`get_noise_multiplier`, RDP, to its 0.01 tolerance; `local` needs twice `central`'s "
            "sigma; reported in the summary) (>= 0)"
        ),
    )


@dataclass(frozen=True)
class SecAggKeys:
    """Flower's SecAgg+ over the shared updates (fedfm_flower/privacy/secagg.py)."""

    group: ClassVar[str] = "secagg"
    title: ClassVar[str] = "Secure aggregation"

    secagg: bool = setting(
        False,
        doc=(
            "secure aggregation of the shared updates with Flower's SecAgg+ "
            "([docs/privacy.md](privacy.md#secure-aggregation-secagg)): the server learns only "
            "the weighted mean of the sampled clients' updates; for the methods on FedAvg's "
            'strategy, not with `dp = "central"` (with `local` it is); a method that cannot take '
            "it is refused at start with the reason"
        ),
    )
    secagg_num_shares: float = setting(
        1.0,
        positive=True,
        doc=(
            "shares each client splits its secrets into: <= 1 a fraction of the round's sampled "
            "clients (made odd, as Flower does), > 1 a count (a whole number >= 3)"
        ),
    )
    secagg_threshold: float = setting(
        0.5,
        positive=True,
        doc=(
            "shares that rebuild a secret: <= 1 a fraction of the shares (at least 2), > 1 a "
            "count (a whole number >= 2, below `secagg-num-shares`); more tolerates fewer "
            "dropouts, fewer protects less against colluding clients"
        ),
    )
    secagg_clipping_range: float = setting(
        8.0,
        positive=True,
        doc=(
            "each value of a client's weighted update (w / `secagg-max-weight` times trained - "
            "received) is clipped to [-range, range] before quantization; the clipped count is "
            "the training metric `secagg-clipped`"
        ),
    )
    secagg_quantization_range: int = setting(
        4194304,
        within=(1, QUANTIZATION_LEVELS),
        bounds="(]",
        note=QUANTIZATION_NOTE,
        doc=(
            "levels over [-range, range] (2**22: a step of 2 range / 2**22); at most 2**22, so "
            "the sum of up to 1,023 clients stays below the masks' 2**32 modulus"
        ),
    )
    secagg_max_weight: float = setting(
        1000.0,
        positive=True,
        doc=(
            "the largest client weight (its `num-examples`; where the method weighs clients "
            "uniformly every client takes this weight); a client above it refuses the round with "
            "that reason; set it near the largest client's `num-examples`, as the quantization "
            "step of a client's update grows by max-weight / weight"
        ),
    )
