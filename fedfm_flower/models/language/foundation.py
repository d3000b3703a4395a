"""The offline foundation language model: a tiny LLaMA pretrained on the public instruction split.

FedDPA fine-tunes LoRA adapters on a frozen alpaca-LoRA (LLaMA-7B instruction-tuned on Alpaca).
No such weights are reachable offline, so the stand-in is a LLaMA of the same architecture
family, scaled down (``TINY_LLAMA``: hidden 128, 4 layers, 4 heads, MLP 256, untied output head,
about one million parameters with the ~1,300-token vocabulary), trained from scratch with AdamW
on the public split of the instruction corpus, which no client holds
(``fedfm_flower.data.instructions``). The loss is the causal-LM loss on the response tokens (and
``</s>``), the prompt masked, as alpaca-LoRA's instruction tuning and FedDPA's fine-tuning do
(``train_on_inputs=False``, see ``encoding``); the loss on every token was measured worse here
(public hold-out ROUGE-L 0.45 against 0.60 after 8 epochs): most prompt tokens are random names
the model cannot predict, which drowns the signal of the responses. Like alpaca-LoRA, the result
knows the prompt format and the tasks somewhat: with 16 epochs (seed 0, public fraction 0.3),
public hold-out ROUGE-L 0.70, 42 s for corpus, tokenizer and pretraining at one thread
(the card records the seconds); LoRA (r = 8 on q/v) on one client's train split then lifts that
client's test ROUGE-L clearly on the generation tasks (e.g. structure-to-text 0.73 -> 0.89),
while most classification tasks start near their ceiling. 16 epochs is the recommended setting;
the time is about linear in the epochs.

Cache. The weights live under ``<cache-dir>/foundation/tiny-llama-<key>.safetensors`` with a
JSON card beside them (key, architecture, ROUGE-1/2/L by greedy generation on a held-out part
of the public split, seconds) and the tokenizer in ``tiny-llama-<key>.tokenizer/``; the key
hashes everything that changes the weights (architecture, tokenizer and corpus versions, corpus
size, public fraction, epochs, seed, optimiser settings). As for the tiny ViT
(``fedfm_flower.models.foundation``), builders serialise on an ``fcntl`` lock and write
atomically with ``fedfm_flower.records.durable``: tokenizer, then card, then weights, whose presence
says the rest is there. The tokenizer and the model are built on the CPU by default, at one
torch thread whatever the builder's count (``models.threads``), so that the cached weights do
not depend on the machine's cores.

``load_pretrained_causal_lm`` is the real loader for users with weights: a Hub name or a local
directory, read with ``AutoModelForCausalLM`` / ``AutoTokenizer``, in a chosen dtype, optionally
placed by accelerate (``device_map="auto"``) or quantized to 4 bits by bitsandbytes (run-config
keys ``model-dtype``, ``device-map``, ``load-in-4bit``; ``pretrained_loading_options``).

Imports inside functions keep ``transformers`` out of this module's start-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from packaging.version import Version

from fedfm_flower.data.instructions import (
    CORPUS_VERSION,
    DEFAULT_EXAMPLES_PER_TASK,
    build_corpus,
    public_split,
)
from fedfm_flower.methods.settings import ConfigError, require_package
from fedfm_flower.models.language.encoding import (
    encode_for_training,
    encode_prompts,
    encoded_length,
    references,
)
from fedfm_flower.models.language.generate import generate
from fedfm_flower.models.language.tokenizer import (
    MODEL_MAX_LENGTH,
    VOCAB_SIZE,
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
)
from fedfm_flower.models.threads import pinned_threads
from fedfm_flower.records.durable import (
    DamagedFileError,
    atomic_write_text,
    exclusive_lock,
    fsync_directory,
    load_tensors,
    save_tensors,
)
from fedfm_flower.tasks.metrics.rouge import rouge_scores

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

    from fedfm_flower.data.instructions import Example

log = logging.getLogger(__name__)

LANGUAGE_FOUNDATION_VERSION = 2  # 2: pretrained at one torch thread (models.threads)
PRETRAIN_LR = 3e-3
PRETRAIN_WEIGHT_DECAY = 0.01
PRETRAIN_BATCH = 16
PRETRAIN_WARMUP = 0.05  # fraction of the steps with a linearly rising learning rate
HOLDOUT_PER_TASK = 8  # public examples per task kept out of pretraining, for the card's ROUGE
MAX_NEW_TOKENS = 24  # enough for every response of the corpus


@dataclass(frozen=True)
class LlamaArch:
    """The shape of the tiny LLaMA (the vocabulary size comes from the tokenizer)."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False


TINY_LLAMA = LlamaArch()


def language_foundation_key(
    seed: int, public_fraction: float, pretrain_epochs: int, examples_per_task: int
) -> str:
    """Hash of every setting that changes the pretrained weights or the tokenizer."""

    fields = {
        "version": LANGUAGE_FOUNDATION_VERSION,
        "arch": asdict(TINY_LLAMA),
        "tokenizer": {"kind": "byte-bpe", "vocab": VOCAB_SIZE, "max_length": MODEL_MAX_LENGTH},
        "corpus": {"version": CORPUS_VERSION, "examples_per_task": examples_per_task},
        "public_fraction": public_fraction,
        "epochs": pretrain_epochs,
        "seed": seed,
        "optim": [PRETRAIN_LR, PRETRAIN_WEIGHT_DECAY, PRETRAIN_BATCH, PRETRAIN_WARMUP],
        "holdout_per_task": HOLDOUT_PER_TASK,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def language_foundation_path(
    cache_dir: Path,
    seed: int,
    public_fraction: float,
    pretrain_epochs: int,
    examples_per_task: int = DEFAULT_EXAMPLES_PER_TASK,
) -> Path:
    """Where the cached weights live (the card and tokenizer sit beside them)."""
    key = language_foundation_key(seed, public_fraction, pretrain_epochs, examples_per_task)
    return Path(cache_dir) / "foundation" / f"tiny-llama-{key}.safetensors"


def tokenizer_dir(weights: Path) -> Path:
    """The tokenizer directory beside cached weights."""
    return weights.with_suffix(".tokenizer")


def ensure_language_foundation(
    cache_dir: Path,
    seed: int,
    public_fraction: float,
    pretrain_epochs: int,
    examples_per_task: int = DEFAULT_EXAMPLES_PER_TASK,
    device: str = "cpu",
) -> Path:
    """Pretrain and cache the tiny LLaMA and its tokenizer unless cached; returns the weights."""
    path = language_foundation_path(
        cache_dir, seed, public_fraction, pretrain_epochs, examples_per_task
    )

    def build() -> None:
        tokenizer, state, card = pretrain_language_foundation(
            seed, public_fraction, pretrain_epochs, examples_per_task, device
        )
        card["key"] = path.stem.removeprefix("tiny-llama-")
        _save_tokenizer_atomically(tokenizer, tokenizer_dir(path))
        atomic_write_text(path.with_suffix(".json"), json.dumps(card, indent=2))
        save_tensors(path, state)  # the weights last: their presence says the rest is there

    _build_once(path, build)
    return path


def load_language_foundation(
    cache_dir: Path,
    seed: int,
    public_fraction: float,
    pretrain_epochs: int,
    examples_per_task: int = DEFAULT_EXAMPLES_PER_TASK,
    device: str = "cpu",
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """The pretrained tiny LLaMA (eval mode, on CPU) and its tokenizer, built if not cached.

    A damaged cache (weights or tokenizer) is pretrained again.
    """

    args = (cache_dir, seed, public_fraction, pretrain_epochs, examples_per_task, device)
    path = ensure_language_foundation(*args)
    try:
        tokenizer = load_tokenizer(tokenizer_dir(path))
        state = load_tensors(path)
    except (DamagedFileError, OSError, ValueError) as err:
        log.warning("cached language foundation model is damaged (%s); pretraining it again", err)
        path.unlink(missing_ok=True)
        path = ensure_language_foundation(*args)
        tokenizer = load_tokenizer(tokenizer_dir(path))
        state = load_tensors(path)
    model = tiny_llama(tokenizer)
    model.load_state_dict(state)
    return model.eval(), tokenizer


def language_foundation_card(
    cache_dir: Path,
    seed: int,
    public_fraction: float,
    pretrain_epochs: int,
    examples_per_task: int = DEFAULT_EXAMPLES_PER_TASK,
) -> dict:
    """The JSON card (ROUGE on the public hold-out, seconds) of the cached model; builds it."""
    path = ensure_language_foundation(
        cache_dir, seed, public_fraction, pretrain_epochs, examples_per_task
    )
    return json.loads(path.with_suffix(".json").read_text())


def tiny_llama(tokenizer: PreTrainedTokenizerBase, seed: int | None = None) -> LlamaForCausalLM:
    """A freshly initialised ``TINY_LLAMA`` sized to ``tokenizer`` (seeded when ``seed`` given)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **asdict(TINY_LLAMA),
    )
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@pinned_threads()
def pretrain_language_foundation(
    seed: int,
    public_fraction: float,
    pretrain_epochs: int,
    examples_per_task: int = DEFAULT_EXAMPLES_PER_TASK,
    device: str = "cpu",
) -> tuple[PreTrainedTokenizerBase, dict[str, torch.Tensor], dict]:
    """Build the tokenizer and pretrain the tiny LLaMA on the public split: (tokenizer, state,
    card)."""

    started = time.perf_counter()
    corpus = build_corpus(seed, examples_per_task)
    tokenizer = build_tokenizer(corpus.examples())
    train_set, holdout = split_public(public_split(corpus, public_fraction))
    model = tiny_llama(tokenizer, seed=seed).to(device)
    loss = causal_lm_pretrain(model, tokenizer, train_set, pretrain_epochs, seed, device)
    trained = time.perf_counter() - started
    model.eval()
    predictions = generate(
        model, tokenizer, encode_prompts(tokenizer, holdout), MAX_NEW_TOKENS, 32, device
    )
    scores = rouge_scores(predictions, references(holdout)) if holdout else {}
    by_task = {
        task: rouge_scores(*zip(*pairs, strict=True))["rouge-l"]
        for task, pairs in _pairs_by_task(holdout, predictions).items()
    }
    card = {
        "model": "tiny-llama",
        "arch": asdict(TINY_LLAMA),
        "vocab_size": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
        "seed": seed,
        "public_fraction": public_fraction,
        "examples_per_task": examples_per_task,
        "public_train_examples": len(train_set),
        "public_holdout_examples": len(holdout),
        "epochs": pretrain_epochs,
        "final_train_loss": loss,
        "public_holdout_rouge": scores,
        "public_holdout_rouge_l_by_task": by_task,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "pretrain_seconds": trained,
        "seconds": time.perf_counter() - started,
    }
    log.info(
        "pretrained offline language foundation model: public hold-out %s in %.1fs",
        {k: round(v, 3) for k, v in scores.items()},
        card["seconds"],
    )
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    return tokenizer, state, card


def split_public(public: Sequence[Example]) -> tuple[list[Example], list[Example]]:
    """(pretraining, hold-out): the last ``HOLDOUT_PER_TASK`` public examples of each task
    are held out, if a task has at least twice as many."""
    by_task: dict[str, list[Example]] = {}
    for example in public:
        by_task.setdefault(example.task, []).append(example)
    train: list[Example] = []
    holdout: list[Example] = []
    for examples in by_task.values():
        cut = len(examples) - HOLDOUT_PER_TASK if len(examples) >= 2 * HOLDOUT_PER_TASK else None
        train.extend(examples[:cut])
        holdout.extend(examples[cut:] if cut is not None else [])
    return train, holdout


def _pairs_by_task(
    examples: Sequence[Example], predictions: Sequence[str]
) -> dict[str, list[tuple[str, str]]]:
    """(prediction, reference) pairs grouped by task."""
    pairs: dict[str, list[tuple[str, str]]] = {}
    for example, prediction in zip(examples, predictions, strict=True):
        pairs.setdefault(example.task, []).append((prediction, example.output))
    return pairs


def causal_lm_pretrain(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[Example],
    epochs: int,
    seed: int,
    device: str | torch.device,
) -> float:
    """AdamW on the causal-LM loss of the responses of ``examples`` (prompts masked), with a
    linear warm-up and decay; returns the last epoch's mean loss."""

    input_ids, attention_mask, labels = encode_for_training(
        tokenizer, examples, encoded_length(tokenizer, examples)
    ).tensors
    count = len(examples)
    steps = max(epochs, 1) * -(-count // PRETRAIN_BATCH)
    warmup = max(1, int(PRETRAIN_WARMUP * steps))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=PRETRAIN_LR, weight_decay=PRETRAIN_WEIGHT_DECAY
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min((step + 1) / warmup, max(0.0, (steps - step) / max(1, steps - warmup))),
    )
    generator = torch.Generator().manual_seed(seed)
    model.train()
    epoch_loss = float("nan")
    for _ in range(max(epochs, 1)):
        total, batches = 0.0, 0
        for rows in torch.randperm(count, generator=generator).split(PRETRAIN_BATCH):
            mask = attention_mask[rows]
            width = int(mask.sum(dim=1).max())  # right padding: drop all-padding columns
            batch = {
                "input_ids": input_ids[rows, :width].to(device),
                "attention_mask": mask[:, :width].to(device),
                "labels": labels[rows, :width].to(device),
            }
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            total, batches = total + loss.item(), batches + 1
        epoch_loss = total / max(batches, 1)
    return epoch_loss


PRETRAINED_DTYPES = ("auto", "float32", "float16", "bfloat16")  # auto: the checkpoint's own


def pretrained_source(name_or_path: str, what: str) -> str:
    """What ``from_pretrained`` should read for ``name_or_path``: a local directory (absolute,
    starting with ``.`` or ``~``, or existing), checked to hold a ``save_pretrained`` model (a
    FileNotFoundError naming it and ``what`` otherwise), else the Hub name as given."""
    local = Path(name_or_path).expanduser()
    looks_local = local.is_absolute() or name_or_path.startswith((".", "~")) or local.exists()
    if looks_local and not (local / "config.json").is_file():
        raise FileNotFoundError(
            f"no {what} at {local}: expected a directory written by "
            "save_pretrained (config.json, weights and tokenizer files)"
        )
    return str(local) if looks_local else name_or_path


def load_pretrained_causal_lm(
    name_or_path: str,
    *,
    dtype: str = "float32",
    device_map: str = "",
    load_in_4bit: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer from a Hub name or a local directory (eval mode, left
    padding, a pad token set to EOS when the tokenizer has none).

    ``dtype``: the weights' dtype, one of ``PRETRAINED_DTYPES`` (``auto``: the checkpoint's own,
    transformers' ``dtype="auto"``). ``device_map="auto"``: accelerate places the model (over
    the GPUs, then the CPU); ``""``: it loads on the CPU. ``load_in_4bit``: NF4 weights with
    double quantization (QLoRA's) via bitsandbytes on the GPU, computing in ``dtype`` (``auto``:
    bfloat16 where the GPU supports it, else float16). Placed or 4-bit models must not be moved.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = pretrained_loading_options(dtype, device_map, load_in_4bit)
    source = pretrained_source(name_or_path, "causal language model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, **options)
    except OSError as err:
        raise FileNotFoundError(
            f"cannot load causal language model {name_or_path!r}: {err} (offline, a Hub name "
            "must already be in the local Hugging Face cache)"
        ) from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.eval(), tokenizer


def pretrained_loading_options(dtype: str, device_map: str, load_in_4bit: bool) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments for run-config keys ``model-dtype`` (resolved),
    ``device-map`` and ``load-in-4bit``; an error naming the key when a need is missing."""

    if dtype not in PRETRAINED_DTYPES:
        raise ConfigError("model-dtype", dtype, f"allowed: {', '.join(PRETRAINED_DTYPES)}")
    if device_map not in ("", "auto"):
        raise ConfigError("device-map", device_map, "allowed: '' (one device), auto")
    options: dict[str, Any] = {}
    if device_map == "auto":
        require_package("device-map", "auto", "accelerate")
        options["device_map"] = "auto"
    weights: str | torch.dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    if load_in_4bit:
        require_package("load-in-4bit", True, "bitsandbytes", " and a CUDA GPU")
        if not torch.cuda.is_available():
            raise ConfigError("load-in-4bit", True, "needs a CUDA GPU; torch sees none")
        from transformers import BitsAndBytesConfig

        if weights == "auto":
            weights = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        options["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=weights,
        )
        options.setdefault("device_map", {"": torch.cuda.current_device()})
    options[dtype_keyword()] = weights
    return options


def dtype_keyword() -> str:
    """The name of transformers' dtype argument and config attribute: ``dtype``, or
    ``torch_dtype`` before transformers 4.56 (the old name warns in 5.x)."""
    import transformers

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def _build_once(path: Path, build: Callable[[], None]) -> None:
    """Run ``build`` (which writes ``path``) unless ``path`` exists, one process at a time."""
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.with_suffix(".lock")):
        if not path.is_file():  # another process may have built it while we waited
            build()


def _save_tokenizer_atomically(tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """Save ``tokenizer`` to a temporary directory and rename it onto ``directory``."""

    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
    try:
        save_tokenizer(tokenizer, staging)
        shutil.rmtree(directory, ignore_errors=True)  # a stale copy from an interrupted build
        os.replace(staging, directory)
        fsync_directory(directory.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
