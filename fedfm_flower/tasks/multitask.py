"""TAP's multi-modal multi-task learning problem: mixed batches, weighted losses, per-pair metrics.

A client's data are the examples of the modality-task pairs it holds
(``fedfm_flower.data.multitask``), all pairs' rows in one dataset, so that a shuffled batch mixes
the pairs as TAP samples its minibatches (sec. 3.1, eq. 2).

Batch (a tuple of tensors, row ``i`` of every tensor is one example)::

    task_index     long  (B,)          index into MULTITASK_TASKS
    images         float (B, 3, S, S)  in [0, 1]; zeros where the pair has no image
    text_ids       long  (B, T)        input text, right-padded with the tokenizer's pad id
    text_mask      long  (B, T)        1 on tokens; an all-zero row where the pair has no text
    labels         long  (B,)          class index; -1 where the pair does not classify
    target_images  float (B, 3, S, S)  the image to reconstruct (image-generation), else zeros
    target_ids     long  (B, U)        <s> + target text + </s>, right-padded (text generation)
    target_mask    long  (B, U)        1 on target tokens; all-zero where there is none

Text is tokenized with the text foundation model's tokenizer (``text_tokenizer``: the tiny
LLaMA's for ``mm-offline``, the checkpoint's for ``mm-flava``/``mm-vilt``, with BERT's ``[CLS]``
and ``[SEP]`` as ``<s>`` and ``</s>``, the configured causal LM's otherwise); inputs and targets
are padded on the *right*: the model encodes the input with an attention mask and decodes the
target causally from ``<s>``, so no left padding is needed. Rows are stored padded to
``max-length`` (cut at the right beyond it, like FedDPA's cutoff; the prompt keeps its ``<s>``);
every batch is trimmed to its longest input (``T``) and target (``U``), at least one column.

The model (``fedfm_flower.models.multimodal``) is called once per pair present in a batch, on
that pair's rows, with only its modalities (``None`` for the others), each input trimmed again
to the pair's longest row: ``model(task, images, text_ids, text_mask[, target_ids])`` returns
class logits (n, C), images (n, 3, S, S) or next-token logits (n, U, V) under teacher forcing
(``logits[:, t]`` predicts ``target_ids[:, t + 1]``). Losses: cross-entropy of the class;
mean squared error over pixels; cross-entropy of every target token after ``<s>`` (``</s>``
included, padding masked), averaged over tokens. A batch's loss is TAP's eq. 2 with
``lambda_o = |H_o| / |H|`` (sec. 5.1): ``sum_o (n_o / B) * loss_o``. ``task_outputs`` exposes
each pair's outputs, targets and loss on a batch, so TAP's distillation (eq. 5-6) works on the
same outputs; ``StepResult.sums`` carries ``loss-<pair>`` (= loss_o * n_o), ``count-<pair>``
(= n_o) and ``share-loss-<pair>`` (= loss_o * n_o / B), from which ``task_losses`` recovers
each pair's training loss on either scale TAP's replacement (eq. 3) may compare: the pair's mean,
or the authors' share-weighted loss (``fedfm_flower/methods/tap.py``).

Evaluation, per pair the client holds: ``accuracy-<pair>`` (classification), ``mse-<pair>``
(image generation, mean over pixels), ``bertscore-<pair>`` (F1) and ``meteor-<pair>`` (text
generation, VQA included: greedy generation of at most ``max-new-tokens`` tokens, cut at
``</s>``; ``fedfm_flower.tasks.metrics.text_generation``, whose ``meteor-wordnet`` flag says whether
WordNet synonyms took part), and ``loss-<pair>``. The loss is the mean of the pairs' losses. The
primary metric ``task-score`` is *our* one-number summary for the progress line and the run
summary: the mean over the client's pairs of accuracy, 1 - MSE and BERTScore F1 (all in
[0, 1], higher is better). The paper reports per-task metrics only (its Tables 1-3); compare
with it per pair.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data.multitask import (
    CLASSIFICATION,
    IMAGE_GENERATION,
    MULTITASK_TASKS,
    PAIRS,
    TEXT_GENERATION,
    MultitaskSettings,
    TaskExamples,
    client_counts,
    client_splits,
    client_tasks,
)
from fedfm_flower.data.sizes import ClientExamples
from fedfm_flower.methods.tap import HISTORIES
from fedfm_flower.models.causal_lm import tokenizer_of
from fedfm_flower.models.families import family_of
from fedfm_flower.models.multimodal import text_foundation_config
from fedfm_flower.models.multimodal_hf import HF_MULTIMODAL, load_tokenizer
from fedfm_flower.tasks.base import Batch, EvalStats, StepResult, Task, TrainStats
from fedfm_flower.tasks.classification import tensor_batches
from fedfm_flower.tasks.metrics.text_generation import (
    METEOR_WORDNET,
    bertscore,
    meteor,
    meteor_variant,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.data.sizes import ClientExamples

NO_LABEL = -1
_IS_IMAGE_GENERATION = torch.tensor([PAIRS[t].kind == IMAGE_GENERATION for t in MULTITASK_TASKS])


@dataclass(frozen=True)
class MultitaskTest:
    """A client's encoded test rows, the reference text of each row and the generation length."""

    encoded: TensorDataset  # the stored row tensors (see ``encode_examples``)
    references: tuple[str, ...]  # target text per row ("" where the pair generates none)
    max_new_tokens: int

    def __len__(self) -> int:
        """Number of test examples."""
        return len(self.references)


@dataclass(frozen=True)
class MultitaskData:
    """One client's data: encoded training rows, the test split and the pairs it holds."""

    train: TensorDataset
    test: MultitaskTest
    tasks: tuple[str, ...]
    val: MultitaskTest | None = None  # None when val-fraction is 0


@dataclass(frozen=True)
class TaskOutput:
    """A pair's outputs on its rows of a batch, the targets and the pair's mean loss."""

    task: str
    rows: torch.Tensor  # positions of the pair's rows in the batch
    outputs: torch.Tensor  # logits (n, C) | images (n, 3, S, S) | next-token logits (n, U, V)
    targets: torch.Tensor  # labels (n,) | images (n, 3, S, S) | target ids (n, U)
    loss: torch.Tensor  # mean per example, per pixel or per scored token
    token_mask: torch.Tensor | None = None  # text: (n, U) bool, outputs[:, t] is scored

    @property
    def count(self) -> int:
        """Examples of the pair in the batch (n_o)."""
        return len(self.rows)

    @property
    def units(self) -> int:
        """How many terms ``loss`` averages: scored tokens for text, else examples."""
        return int(self.token_mask.sum()) if self.token_mask is not None else self.count


# --- text ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _foundation_tokenizer(text_config: ExperimentConfig) -> Any:

    return tokenizer_of(text_config)


@functools.lru_cache(maxsize=2)
def _checkpoint_tokenizer(backbone: str, model_name_or_path: str) -> Any:

    where = ExperimentConfig(
        dataset="multitask", backbone=backbone, model_name_or_path=model_name_or_path
    )
    return load_tokenizer(where)


def text_tokenizer(config: ExperimentConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of the model's text: the configured causal LM's, the FLAVA/ViLT
    checkpoint's for ``mm-flava``/``mm-vilt``, else that of the tiny LLaMA the multi-modal
    model's text parts come from (once per process)."""

    if family_of(config.backbone).name == "causal-lm":
        return tokenizer_of(config)

    if config.backbone in HF_MULTIMODAL:
        return _checkpoint_tokenizer(config.backbone, config.model_name_or_path)

    return _foundation_tokenizer(text_foundation_config(config))


def _padded(rows: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """(ids, mask) of ``rows`` cut to ``width`` and right-padded with ``pad_id``."""
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        tokens = list(tokens)[:width]
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, : len(tokens)] = 1
    return ids, mask


def encode_examples(
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[TaskExamples],
    image_size: int,
    max_length: int,
) -> TensorDataset:
    """Row tensors of ``examples`` (pairs one after the other): (task_index, images, text_ids,
    text_mask, labels, target_ids, target_mask); texts right-padded to ``max_length``."""
    pad, bos, eos = tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    parts = []
    for part in examples:
        n, spec = len(part), PAIRS[part.task]
        images = (
            part.images if part.images is not None else torch.zeros(n, 3, image_size, image_size)
        )
        if images.shape[1:] != (3, image_size, image_size):
            raise ValueError(
                f"{part.task} images are {tuple(images.shape[1:])}, not 3x{image_size}"
            )
        prompts: list[list[int]] = [[] for _ in range(n)]
        if "text" in spec.modalities and n:
            prompts = tokenizer(list(part.prompts))["input_ids"]
        targets: list[list[int]] = [[] for _ in range(n)]
        if spec.kind == TEXT_GENERATION and n:
            answers = tokenizer(list(part.targets), add_special_tokens=False)["input_ids"]
            targets = [[bos, *answer, eos] for answer in answers]
        labels = torch.full((n,), NO_LABEL, dtype=torch.long)
        if part.labels is not None:
            labels = torch.as_tensor(part.labels, dtype=torch.long)
        parts.append(
            (
                torch.full((n,), MULTITASK_TASKS.index(part.task), dtype=torch.long),
                images.float(),
                *_padded(prompts, max_length, pad),
                labels,
                *_padded(targets, max_length, pad),
            )
        )
    if not parts:  # a client without examples: empty tensors of the right shapes
        parts.append(
            (
                torch.zeros(0, dtype=torch.long),
                torch.zeros(0, 3, image_size, image_size),
                *_padded([], max_length, pad),
                torch.zeros(0, dtype=torch.long),
                *_padded([], max_length, pad),
            )
        )
    return TensorDataset(*(torch.cat(column) for column in zip(*parts, strict=True)))


def decode_generated(tokenizer: PreTrainedTokenizerBase, ids: torch.Tensor) -> list[str]:
    """Texts of generated token ids (B, L): each row cut at its first ``</s>``, specials
    dropped, stripped."""
    texts = []
    for row in ids.tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True).strip())
    return texts


# --- batches and losses ------------------------------------------------------------------


def _trim(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``ids``/``mask`` cut to their longest row (at least one column)."""
    width = max(int(mask.sum(1).max()) if len(mask) else 0, 1)
    return ids[:, :width], mask[:, :width]


def contract_batch(rows: Sequence[torch.Tensor]) -> Batch:
    """The 8-tensor batch of stored rows: target images added, texts trimmed."""
    task_index, images, text_ids, text_mask, labels, target_ids, target_mask = rows
    is_generation = _IS_IMAGE_GENERATION.to(task_index.device)[task_index]
    target_images = images * is_generation[:, None, None, None].to(images.dtype)
    return (
        task_index,
        images,
        *_trim(text_ids, text_mask),
        labels,
        target_images,
        *_trim(target_ids, target_mask),
    )


def multitask_batches(
    data: TensorDataset, batch_size: int, generator: torch.Generator | None
) -> Iterator[Batch]:
    """Batches of mixed pairs' rows (seeded order, or in order), in the batch contract."""
    for rows in tensor_batches(data, batch_size, generator):
        yield contract_batch(rows)


def _task_output(model: nn.Module, batch: Batch, task: str, rows: torch.Tensor) -> TaskOutput:
    """``task``'s model call and loss on ``rows`` of ``batch``."""
    labels, target_images, target_ids, target_mask = batch[4:]
    spec = PAIRS[task]
    image, ids, mask = _inputs(batch, task, rows)
    if spec.kind == CLASSIFICATION:
        logits = model(task, image, ids, mask)
        targets = labels[rows]
        return TaskOutput(task, rows, logits, targets, F.cross_entropy(logits, targets))
    if spec.kind == IMAGE_GENERATION:
        generated = model(task, image, ids, mask)
        targets = target_images[rows]
        return TaskOutput(task, rows, generated, targets, F.mse_loss(generated, targets))
    targets, scored = _trim(target_ids[rows], target_mask[rows])
    logits = model(task, image, ids, mask, targets)
    token_mask = torch.zeros_like(scored, dtype=torch.bool)
    token_mask[:, :-1] = scored[:, 1:].bool()  # logits[:, t] predicts targets[:, t + 1]
    next_tokens = targets.roll(-1, dims=1)
    if token_mask.any():
        loss = F.cross_entropy(logits[token_mask], next_tokens[token_mask])
    else:  # only <s> survived the cut: nothing to predict
        loss = logits.sum() * 0.0
    return TaskOutput(task, rows, logits, targets, loss, token_mask)


def _inputs(
    batch: Batch, task: str, rows: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(images, text_ids, text_mask) of ``rows`` for ``task``: None for modalities it lacks."""
    _, images, text_ids, text_mask = batch[:4]
    modalities = PAIRS[task].modalities
    image = images[rows] if "image" in modalities else None
    if "text" not in modalities:
        return image, None, None
    return (image, *_trim(text_ids[rows], text_mask[rows]))


def generate(model: nn.Module, task: str, batch: Batch, max_new_tokens: int) -> torch.Tensor:
    """Greedy new token ids (B, <= max_new_tokens) of ``model`` for a batch of one pair."""
    rows = torch.arange(len(batch[0]), device=batch[0].device)
    return model.generate(task, *_inputs(batch, task, rows), max_new_tokens=max_new_tokens)


def task_outputs(model: nn.Module, batch: Batch) -> dict[str, TaskOutput]:
    """{pair: its outputs, targets and mean loss} for every pair present in ``batch``."""
    task_index = batch[0]
    present = torch.bincount(task_index, minlength=len(MULTITASK_TASKS)).tolist()
    return {
        task: _task_output(model, batch, task, (task_index == index).nonzero().squeeze(1))
        for index, task in enumerate(MULTITASK_TASKS)
        if present[index]
    }


def weighted_loss(outputs: Mapping[str, TaskOutput], batch_size: int) -> torch.Tensor:
    """TAP's eq. 2 with lambda_o = n_o / B: ``sum_o (n_o / B) * loss_o``."""
    return sum(out.loss * (out.count / batch_size) for out in outputs.values())


def task_losses(stats: TrainStats, scale: str = "pair-mean") -> dict[str, float]:
    """Each seen pair's training loss over one local loop, on ``scale``.

    ``pair-mean``: sum of the pair's per-example losses over its examples (``loss-<pair>`` over
    ``count-<pair>``; the loop's division by all examples cancels). ``share-weighted``: the
    authors' ``train_client``, sum over batches of (n_o / B) * loss_o over the number of batches
    (``share-loss-<pair>`` times examples seen over steps; a batch without the pair adds 0).
    """
    if scale not in HISTORIES:
        raise ValueError(f"loss scale '{scale}' unknown; allowed: {', '.join(HISTORIES)}")
    metrics, losses = stats.metrics, {}
    for task in MULTITASK_TASKS:
        if metrics.get(f"count-{task}", 0.0) <= 0:
            continue
        if scale == "pair-mean":
            losses[task] = metrics[f"loss-{task}"] / metrics[f"count-{task}"]
        else:
            losses[task] = metrics[f"share-loss-{task}"] * stats.examples_seen / stats.num_steps
    return losses


def build_client_data(
    settings: MultitaskSettings,
    tokenizer: PreTrainedTokenizerBase,
    partition_id: int,
    num_partitions: int,
    *,
    max_length: int,
    max_new_tokens: int,
) -> MultitaskData:
    """A client's encoded train rows, test and validation splits (``client_data`` without a
    run config)."""
    splits = client_splits(settings, partition_id, num_partitions)

    def encode(parts: list[TaskExamples]) -> TensorDataset:
        return encode_examples(tokenizer, parts, settings.image_size, max_length)

    def evaluation_split(parts: list[TaskExamples]) -> MultitaskTest:
        targets = tuple(t for part in parts for t in part.targets)
        return MultitaskTest(encode(parts), targets, max_new_tokens)

    return MultitaskData(
        encode([train for train, _, _ in splits.values()]),
        evaluation_split([test for _, test, _ in splits.values()]),
        tuple(splits),
        evaluation_split([val for _, _, val in splits.values()])
        if settings.val_fraction > 0
        else None,
    )


# --- the task -----------------------------------------------------------------------------


class MultimodalMultitask(Task):
    """TAP's modality-task pairs; metrics: per-pair accuracy, MSE, BERTScore, METEOR."""

    name = "multimodal-multitask"
    primary_metric = "task-score"
    modality = "multimodal"

    def client_data(
        self, config: ExperimentConfig, partition_id: int, num_partitions: int
    ) -> MultitaskData:
        """The client's pairs' examples, encoded with the text foundation model's tokenizer."""
        return build_client_data(
            MultitaskSettings.of(config),
            text_tokenizer(config),
            partition_id,
            num_partitions,
            max_length=config.max_length,
            max_new_tokens=config.max_new_tokens,
        )

    def example_counts(self, config: ExperimentConfig, num_clients: int) -> list[ClientExamples]:
        """Train/test sizes of every client (summed over its pairs; nothing decoded)."""

        settings = MultitaskSettings.of(config)
        counts = []
        for client in range(num_clients):
            sizes = client_counts(settings, client, num_clients).values()
            counts.append(ClientExamples(sum(s[0] for s in sizes), sum(s[1] for s in sizes), 0))
        return counts

    def client_labels(self, config: ExperimentConfig, num_clients: int) -> dict[str, str]:
        """{client id: its pairs joined by "+"}."""
        return {c: "+".join(held) for c, held in self.client_holdings(config, num_clients).items()}

    def holdings(self, data: Any) -> tuple[str, ...]:
        """The client's modality-task pairs: its model components are theirs."""
        return tuple(data.tasks)

    def client_holdings(
        self, config: ExperimentConfig, num_clients: int
    ) -> dict[str, tuple[str, ...]]:
        """{client id: its modality-task pairs}."""
        return {str(p): client_tasks(p, num_clients) for p in range(num_clients)}

    def batches(
        self, data: Any, batch_size: int, generator: torch.Generator | None
    ) -> Iterator[Batch]:
        """Mixed-pair batches in the batch contract (module docstring)."""
        return multitask_batches(data, batch_size, generator)

    def step(self, model: nn.Module, batch: Batch) -> StepResult:
        """TAP's weighted loss; ``loss-``, ``count-`` and ``share-loss-<pair>`` sums per pair."""
        outputs = task_outputs(model, batch)
        batch_size = len(batch[0])
        sums: dict[str, float] = {}
        for task, out in outputs.items():
            loss = out.loss.item()
            sums[f"loss-{task}"] = loss * out.count
            sums[f"count-{task}"] = float(out.count)
            sums[f"share-loss-{task}"] = loss * out.count / batch_size
        return StepResult(weighted_loss(outputs, batch_size), batch_size, sums)

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, data: Any, device: torch.device, batch_size: int
    ) -> EvalStats:
        """Per-pair loss and metrics, their mean loss and ``task-score`` (module docstring)."""

        model.eval()
        test: MultitaskTest = data
        tensors = test.encoded.tensors
        metrics: dict[str, float] = {}
        losses, scores = [], []
        for index, task in enumerate(MULTITASK_TASKS):
            positions = (tensors[0] == index).nonzero().squeeze(1)
            if len(positions) == 0:
                continue
            kind = PAIRS[task].kind
            loss_sum, units, correct = 0.0, 0, 0
            predictions: list[str] = []
            for start in range(0, len(positions), batch_size):
                chunk = positions[start : start + batch_size]
                batch = tuple(t.to(device) for t in contract_batch([t[chunk] for t in tensors]))
                out = _task_output(model, batch, task, torch.arange(len(chunk), device=device))
                loss_sum += out.loss.item() * out.units
                units += out.units
                if kind == CLASSIFICATION:
                    correct += int((out.outputs.argmax(1) == out.targets).sum())
                elif kind == TEXT_GENERATION:
                    generated = generate(model, task, batch, test.max_new_tokens)
                    predictions += decode_generated(model.tokenizer, generated)
            loss = loss_sum / max(units, 1)
            metrics[f"loss-{task}"] = loss
            losses.append(loss)
            if kind == CLASSIFICATION:
                metrics[f"accuracy-{task}"] = correct / len(positions)
                scores.append(metrics[f"accuracy-{task}"])
            elif kind == IMAGE_GENERATION:
                metrics[f"mse-{task}"] = loss
                scores.append(1.0 - loss)
            else:
                references = [test.references[i] for i in positions.tolist()]
                metrics[f"bertscore-{task}"] = bertscore(predictions, references).f1
                metrics[f"meteor-{task}"] = meteor(predictions, references)
                metrics["meteor-wordnet"] = float(meteor_variant() == METEOR_WORDNET)
                scores.append(metrics[f"bertscore-{task}"])
        metrics["task-score"] = sum(scores) / len(scores) if scores else 0.0
        mean_loss = sum(losses) / len(losses) if losses else 0.0
        return EvalStats(mean_loss, metrics, len(test))
