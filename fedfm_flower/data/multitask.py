"""``multitask``: TAP's multi-modal multi-task federation, built offline from the project's data.

TAP (sec. 3.1, 5.1) gives each client a subset of modality-task pairs. Its FLAVA setting spreads
eight datasets over 30 clients: image classification (tiny-ImageNet, CIFAR-100), image
generation as reconstruction (Fashion-MNIST, Caltech-256), VQA (VQAv2 small), text
classification (AG News) and text generation (MMLU, CommonGen). None of these is reachable
offline, so this module builds five pairs of the same kinds from material the project already
has, in this fixed order (``MULTITASK_TASKS``, the ``task_index`` of a batch):

==============  ==========================  ===================  ==============================
pair            input -> output             kind                 paper's counterpart
==============  ==========================  ===================  ==============================
``image-cls``   glyph image -> digit (10)   classification       tiny-ImageNet, CIFAR-100
``image-gen``   glyph image -> same image   image-generation     Fashion-MNIST, Caltech-256
``vqa``         glyph image + question      text-generation      VQAv2 (Table 23's template)
                -> short answer
``text-cls``    question -> answer type (5) classification       AG News
``text-gen``    record -> sentence          text-generation      CommonGen, MMLU
==============  ==========================  ===================  ==============================

Images come from the glyph-domains benchmark (``fedfm_flower.data.glyphs``: ten digit classes
in six styles, 32x32, resized to ``image-size`` bilinearly as ``glyph_source`` does), from its
*clients'* pool only: the public pool pretrains the offline ViT the model uses, so no public
image is ever used here. Each image task draws its own images, disjoint from the others', from
fixed styles, two per task as the paper has two datasets per image task: ``image-cls`` from
``painting`` and ``sketch`` (coloured natural-looking images and line drawings), ``image-gen``
from ``handwriting`` and ``photo`` (Fashion-MNIST's plain strokes, Caltech's photographs);
``vqa`` from all six styles (its style question needs them), an equal share of each. Within a
task the styles are mixed in a seeded order, so its clients' shares are alike (i.i.d.). With
``style_skew`` (run config ``multitask-style-skew``) they are not mixed: a task's images stay
grouped by style, so its holders' contiguous shares each come from one style (or two, where a
share straddles the boundary): the first half of ``image-cls``'s holders get paintings, the
second half sketches, as the paper gives a pair's clients different datasets. The same images
are used either way.

VQA asks one question per image, drawn with the seed: "What digit is shown?" (or "Which number
is in the image?") -> the digit's word ("seven"); "What is the style of the image?" -> the
style's word (``STYLE_WORDS``: printed, handwritten, photo, sketch, painting, blurry); "Is the
digit even or odd?" -> "even" / "odd". The prompt is TAP's VQA template (its Table 23):
"Answer the question based on the image.\\nQuestion: {question}\\nAnswer:".

Texts come from the offline instruction corpus (``fedfm_flower.data.instructions``) of the
run's seed, extended beyond its default 200 examples per task (the corpus is generated in a
fixed order, so a larger corpus starts with the smaller one). The examples that pretrain the
tiny LLaMA, its public split (the first ``public-fraction`` of the 200-example corpus of each
task), are skipped. ``text-cls`` is the corpus' ``question_classification`` (TREC-like; label =
the answer's index in ``TEXT_CLASSES``, sorted), its input the corpus prompt (FedDPA's template,
with the OPTIONS list); ``text-gen`` is ``structure_to_text`` (WebNLG-like records -> a
sentence: the CommonGen-like "concepts -> description" task), prompt -> response. The corpus'
own prompt is kept rather than TAP's CommonGen/MMLU templates because the text foundation model
was pretrained on it.

Clients. TAP's 30 clients form 3 groups of 10 (``GROUPS``): group 0 holds {image-cls,
image-gen}, group 1 {text-cls, text-gen}, group 2 {vqa, image-cls, text-gen}. Client ``p`` of
``n`` is in group ``3 * p // n``: contiguous groups of near-equal size (``p // 10`` for 30
clients; with 4 clients the groups are {0, 1}, {2}, {3}, so every pair has a holder as soon as
there are 3 clients; ``ceil(n / 3)``-sized groups would leave group 2 empty for 4 clients).
Each pair has a fixed number of non-public examples (``MultitaskSizes``: by default 60 per
holder with 30 clients); the clients that hold a pair split them into disjoint, contiguous,
near-equal shares (in rank order), and each client's share into test (a seeded
``test-fraction``, at least one example) and train. The experiment seed changes which examples
and questions go where; the pixels are the benchmark's (fixed).

Imports inside functions keep ``torch`` out of this module's start-up.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedfm_flower.data.glyphs import (
    DOMAINS,
    NATIVE_SIZE,
    NUM_CLASSES,
    GlyphArrays,
    GlyphSizes,
    cached_arrays,
)
from fedfm_flower.data.instructions import (
    DEFAULT_EXAMPLES_PER_TASK,
    build_corpus,
    format_prompt,
    public_count,
)

if TYPE_CHECKING:
    import torch

    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.data.instructions import Corpus

CLASSIFICATION = "classification"
IMAGE_GENERATION = "image-generation"
TEXT_GENERATION = "text-generation"
KINDS: tuple[str, ...] = (CLASSIFICATION, IMAGE_GENERATION, TEXT_GENERATION)
MODALITIES: tuple[str, ...] = ("image", "text")

MULTITASK_TASKS: tuple[str, ...] = ("image-cls", "image-gen", "vqa", "text-cls", "text-gen")
TEXT_CLASSES: tuple[str, ...] = ("date", "location", "number", "person", "reason")


@dataclass(frozen=True)
class PairSpec:
    """One modality-task pair: its kind, the modalities of its input, its classes."""

    kind: str
    modalities: tuple[str, ...]
    num_classes: int = 0  # classification only

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"task kind '{self.kind}' unknown; known: {', '.join(KINDS)}")
        if not self.modalities or set(self.modalities) - set(MODALITIES):
            raise ValueError(f"modalities {self.modalities} invalid; known: {MODALITIES}")
        if (self.kind == CLASSIFICATION) != (self.num_classes > 0):
            raise ValueError("num_classes is positive exactly for classification pairs")

    @property
    def type(self) -> str:
        """TAP's task type (its Table 22): ``<modality>-classification`` by the input's
        modality, ``image-generation``, or ``text-generation`` (VQA's answers are text)."""
        if self.kind == CLASSIFICATION:
            return f"{self.modalities[0]}-classification"
        return self.kind


PAIRS: dict[str, PairSpec] = {
    "image-cls": PairSpec(CLASSIFICATION, ("image",), NUM_CLASSES),
    "image-gen": PairSpec(IMAGE_GENERATION, ("image",)),
    "vqa": PairSpec(TEXT_GENERATION, ("image", "text")),
    "text-cls": PairSpec(CLASSIFICATION, ("text",), len(TEXT_CLASSES)),
    "text-gen": PairSpec(TEXT_GENERATION, ("text",)),
}

GROUPS: tuple[tuple[str, ...], ...] = (
    ("image-cls", "image-gen"),
    ("text-cls", "text-gen"),
    ("vqa", "image-cls", "text-gen"),
)

# Which glyph styles feed which image task, and which corpus task feeds which text task.
IMAGE_DOMAINS: dict[str, tuple[str, ...]] = {
    "vqa": DOMAINS,
    "image-cls": ("painting", "sketch"),
    "image-gen": ("handwriting", "photo"),
}
TEXT_SOURCES: dict[str, str] = {
    "text-cls": "question_classification",
    "text-gen": "structure_to_text",
}
# The tiny LLaMA is pretrained on the public split of the corpus of this size (its default).
FOUNDATION_EXAMPLES_PER_TASK = DEFAULT_EXAMPLES_PER_TASK

VQA_TEMPLATE = "Answer the question based on the image.\nQuestion: {question}\nAnswer:"
DIGIT_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
)  # fmt: skip
STYLE_WORDS: dict[str, str] = {
    "print": "printed",
    "handwriting": "handwritten",
    "photo": "photo",
    "sketch": "sketch",
    "painting": "painting",
    "noisy-blur": "blurry",
}
VQA_QUESTIONS: dict[str, tuple[str, ...]] = {
    "digit": ("What digit is shown?", "Which number is in the image?"),
    "style": ("What is the style of the image?",),
    "parity": ("Is the digit even or odd?",),
}


@dataclass(frozen=True)
class MultitaskSizes:
    """Non-public examples of each pair (shared by its holders) and the glyph generation."""

    image_cls: int = 1200
    image_gen: int = 600
    vqa: int = 600
    text_cls: int = 600
    text_gen: int = 1200
    glyphs: GlyphSizes = field(default_factory=GlyphSizes)

    def total(self, task: str) -> int:
        """How many non-public examples pair ``task`` has."""
        if task not in PAIRS:
            raise ValueError(f"task '{task}' unknown; known: {', '.join(MULTITASK_TASKS)}")
        return getattr(self, task.replace("-", "_"))


@dataclass(frozen=True)
class MultitaskSettings:
    """What the federation's data depend on (the run config's relevant part)."""

    cache_dir: str
    seed: int = 0
    public_fraction: float = 0.3
    test_fraction: float = 0.2
    val_fraction: float = 0.0  # of each share, after the test part; 0: no validation split
    image_size: int = NATIVE_SIZE
    sizes: MultitaskSizes = field(default_factory=MultitaskSizes)
    style_skew: bool = False  # an image pair's holders each get one style (module docstring)

    @classmethod
    def of(cls, config: ExperimentConfig) -> MultitaskSettings:
        """The settings of a run config (default sizes)."""
        return cls(
            cache_dir=str(config.cache_path),
            seed=config.effective_data_seed,
            public_fraction=config.public_fraction,
            test_fraction=config.test_fraction,
            val_fraction=config.val_fraction,
            image_size=config.image_size,
            style_skew=config.multitask_style_skew,
        )


@dataclass(frozen=True, eq=False)
class TaskExamples:
    """Raw examples of one pair: images, prompts, labels and target texts, row by row."""

    task: str
    ids: tuple[str, ...]  # stable names: "glyph:<sample id>" or "<corpus task>:<corpus index>"
    images: torch.Tensor | None  # float [n, 3, S, S] in [0, 1]; None for text-only pairs
    prompts: tuple[str, ...]  # input text ("" for image-only pairs)
    labels: np.ndarray | None  # int64 [n] for classification pairs, else None
    targets: tuple[str, ...]  # target text ("" unless the pair generates text)

    def __len__(self) -> int:
        """Number of examples."""
        return len(self.ids)

    def digest(self) -> str:
        """SHA-256 of every field (pixels included)."""
        digest = hashlib.sha256(self.task.encode())
        for texts in (self.ids, self.prompts, self.targets):
            digest.update("\x00".join(texts).encode())
        if self.labels is not None:
            digest.update(np.ascontiguousarray(self.labels).tobytes())
        if self.images is not None:
            digest.update(self.images.contiguous().numpy().tobytes())
        return digest.hexdigest()


@dataclass(frozen=True, eq=False)
class _Pool:
    """A pair's non-public examples in their seeded order, pixels not yet decoded."""

    ids: tuple[str, ...]
    glyph_ids: np.ndarray | None
    prompts: tuple[str, ...]
    labels: np.ndarray | None
    targets: tuple[str, ...]


# --- clients and their tasks -------------------------------------------------------------


def client_group(partition_id: int, num_partitions: int) -> int:
    """The group (index into ``GROUPS``) of client ``partition_id``: contiguous, near-equal."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id {partition_id} is not in [0, {num_partitions})")
    return len(GROUPS) * partition_id // num_partitions


def client_tasks(partition_id: int, num_partitions: int) -> tuple[str, ...]:
    """The pairs client ``partition_id`` holds, in ``MULTITASK_TASKS`` order."""
    held = GROUPS[client_group(partition_id, num_partitions)]
    return tuple(task for task in MULTITASK_TASKS if task in held)


def task_holders(task: str, num_partitions: int) -> tuple[int, ...]:
    """The clients that hold pair ``task``, in order."""
    return tuple(p for p in range(num_partitions) if task in client_tasks(p, num_partitions))


def _split_positions(
    settings: MultitaskSettings, task: str, partition_id: int, num_partitions: int
) -> tuple[list[int], list[int], list[int]]:
    """(train, test, validation) positions in ``task``'s pool of the client's share: the
    shuffled share's first ``test_fraction`` is test, the next ``val_fraction`` validation (so
    the test split does not depend on ``val_fraction``), the rest train."""
    if not 0.0 < settings.test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {settings.test_fraction}")
    holders = task_holders(task, num_partitions)
    rank, total = holders.index(partition_id), settings.sizes.total(task)
    share = list(range(total * rank // len(holders), total * (rank + 1) // len(holders)))
    random.Random(f"fedfm-multitask-test:{settings.seed}:{task}:{partition_id}").shuffle(share)
    test_size = max(1, math.floor(settings.test_fraction * len(share))) if share else 0
    val_size = max(1, math.floor(settings.val_fraction * len(share))) if share else 0
    val_end = test_size + (val_size if settings.val_fraction > 0 else 0)
    return share[val_end:], share[:test_size], share[test_size:val_end]


def client_counts(
    settings: MultitaskSettings, partition_id: int, num_partitions: int
) -> dict[str, tuple[int, int]]:
    """{pair: (train, test) example counts} of a client, without building any example."""
    counts = {}
    for task in client_tasks(partition_id, num_partitions):
        train, test, _ = _split_positions(settings, task, partition_id, num_partitions)
        counts[task] = (len(train), len(test))
    return counts


def client_examples(
    settings: MultitaskSettings, partition_id: int, num_partitions: int
) -> dict[str, tuple[TaskExamples, TaskExamples]]:
    """{pair: (train, test)} raw examples of client ``partition_id``, pairs in order."""
    return {
        task: (train, test)
        for task, (train, test, _) in client_splits(settings, partition_id, num_partitions).items()
    }


def client_splits(
    settings: MultitaskSettings, partition_id: int, num_partitions: int
) -> dict[str, tuple[TaskExamples, TaskExamples, TaskExamples]]:
    """{pair: (train, test, validation)} raw examples of client ``partition_id``, pairs in
    order (validation empty when ``val_fraction`` is 0)."""
    pools = task_pools(
        settings.cache_dir,
        settings.seed,
        settings.public_fraction,
        settings.sizes,
        settings.style_skew,
    )
    arrays = _glyph_arrays(settings.cache_dir, settings.sizes.glyphs)
    examples = {}
    for task in client_tasks(partition_id, num_partitions):
        examples[task] = tuple(
            _take(task, pools[task], positions, arrays, settings.image_size)
            for positions in _split_positions(settings, task, partition_id, num_partitions)
        )
    return examples


def _take(
    task: str, pool: _Pool, positions: list[int], arrays: GlyphArrays, image_size: int
) -> TaskExamples:
    """The examples at ``positions`` of ``pool``, pixels decoded."""
    index = np.asarray(positions, dtype=np.int64)
    images = None
    if pool.glyph_ids is not None:
        images = glyph_pixels(arrays, pool.glyph_ids[index], image_size)
    return TaskExamples(
        task=task,
        ids=tuple(pool.ids[i] for i in positions),
        images=images,
        prompts=tuple(pool.prompts[i] for i in positions),
        labels=None if pool.labels is None else pool.labels[index],
        targets=tuple(pool.targets[i] for i in positions),
    )


def glyph_pixels(arrays: GlyphArrays, sample_ids: np.ndarray, image_size: int) -> torch.Tensor:
    """Images ``sample_ids`` as ``[n, 3, S, S]`` floats in [0, 1], resized like
    ``glyph_source``."""
    import torch
    import torch.nn.functional as F

    if len(sample_ids) == 0:
        return torch.zeros((0, 3, image_size, image_size))
    chosen = torch.from_numpy(arrays.images[sample_ids]).permute(0, 3, 1, 2).float().div_(255.0)
    if image_size == NATIVE_SIZE:
        return chosen.contiguous()
    return F.interpolate(chosen, size=(image_size, image_size), mode="bilinear").clamp_(0, 1)


# --- the pools ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _glyph_arrays(cache_dir: str, sizes: GlyphSizes) -> GlyphArrays:
    """The glyph benchmark (cached on disk under ``cache_dir``, read once per process)."""

    return cached_arrays(Path(cache_dir), sizes)


@functools.lru_cache(maxsize=2)
def _corpus(seed: int, examples_per_task: int) -> Corpus:
    return build_corpus(seed, examples_per_task)


def public_text_count(public_fraction: float) -> int:
    """How many examples of each corpus task pretrain the tiny LLaMA (skipped here)."""
    return public_count(FOUNDATION_EXAMPLES_PER_TASK, public_fraction)


@functools.lru_cache(maxsize=2)
def task_pools(
    cache_dir: str,
    seed: int,
    public_fraction: float,
    sizes: MultitaskSizes,
    style_skew: bool = False,
) -> dict[str, _Pool]:
    """Every pair's non-public examples in their seeded order (clients take shares of them)."""
    pools = _image_pools(_glyph_arrays(cache_dir, sizes.glyphs), seed, sizes, style_skew)
    pools.update(_text_pools(seed, public_fraction, sizes))
    return {task: pools[task] for task in MULTITASK_TASKS}


def _spread(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal integers."""
    return [total * (k + 1) // parts - total * k // parts for k in range(parts)]


def _image_pools(
    arrays: GlyphArrays, seed: int, sizes: MultitaskSizes, style_skew: bool = False
) -> dict[str, _Pool]:
    """Disjoint glyph images of the clients' pool for vqa, image-cls and image-gen, styles
    mixed (or, with ``style_skew``, grouped by style in ``IMAGE_DOMAINS`` order)."""
    rng = np.random.default_rng([seed, 2026, 18])
    order = {
        domain: rng.permutation(np.flatnonzero((arrays.domains == d) & ~arrays.public))
        for d, domain in enumerate(DOMAINS)
    }
    used = dict.fromkeys(DOMAINS, 0)
    chosen: dict[str, np.ndarray] = {}
    for task in ("vqa", "image-cls", "image-gen"):
        domains = IMAGE_DOMAINS[task]
        parts = []
        for domain, count in zip(domains, _spread(sizes.total(task), len(domains)), strict=True):
            if used[domain] + count > len(order[domain]):
                raise ValueError(
                    f"glyph style '{domain}' has {len(order[domain])} client images; the "
                    f"multitask sizes ask for {used[domain] + count} (raise GlyphSizes."
                    "per_domain or lower the pairs' sizes)"
                )
            parts.append(order[domain][used[domain] : used[domain] + count])
            used[domain] += count
        mixed = rng.permutation(np.concatenate(parts))  # drawn either way: same later draws
        chosen[task] = np.concatenate(parts) if style_skew else mixed
    ids = {task: tuple(f"glyph:{i}" for i in chosen[task]) for task in chosen}
    empty = {task: ("",) * len(chosen[task]) for task in chosen}
    pools = {
        "image-cls": _Pool(
            ids["image-cls"],
            chosen["image-cls"],
            empty["image-cls"],
            arrays.labels[chosen["image-cls"]].astype(np.int64),
            empty["image-cls"],
        ),
        "image-gen": _Pool(
            ids["image-gen"], chosen["image-gen"], empty["image-gen"], None, empty["image-gen"]
        ),
    }
    questions = _vqa_questions(arrays, chosen["vqa"], seed)
    pools["vqa"] = _Pool(
        ids["vqa"],
        chosen["vqa"],
        tuple(VQA_TEMPLATE.format(question=q) for q, _ in questions),
        None,
        tuple(a for _, a in questions),
    )
    return pools


def _vqa_questions(arrays: GlyphArrays, sample_ids: np.ndarray, seed: int) -> list[tuple[str, str]]:
    """One (question, answer) per image, the question drawn with ``seed``."""
    rng = random.Random(f"fedfm-multitask-vqa:{seed}")
    pairs = []
    for sample in sample_ids:
        label, domain = int(arrays.labels[sample]), DOMAINS[int(arrays.domains[sample])]
        kind = rng.choice(tuple(VQA_QUESTIONS))
        question = rng.choice(VQA_QUESTIONS[kind])
        answer = {
            "digit": DIGIT_WORDS[label],
            "style": STYLE_WORDS[domain],
            "parity": "even" if label % 2 == 0 else "odd",
        }[kind]
        pairs.append((question, answer))
    return pairs


def _text_pools(seed: int, public_fraction: float, sizes: MultitaskSizes) -> dict[str, _Pool]:
    """The corpus examples after the tiny LLaMA's public split, for text-cls and text-gen."""
    skip = public_text_count(public_fraction)
    corpus = _corpus(seed, skip + max(sizes.total(task) for task in TEXT_SOURCES))
    pools = {}
    for task, source in TEXT_SOURCES.items():
        start = skip
        examples = corpus.by_task[source][start : start + sizes.total(task)]
        ids = tuple(f"{source}:{start + k}" for k in range(len(examples)))
        prompts = tuple(format_prompt(e.instruction, e.input) for e in examples)
        empty = ("",) * len(examples)
        if PAIRS[task].kind == CLASSIFICATION:
            unknown = {e.output for e in examples} - set(TEXT_CLASSES)
            if unknown:
                raise ValueError(f"'{source}' has answers outside TEXT_CLASSES: {unknown}")
            labels = np.array([TEXT_CLASSES.index(e.output) for e in examples], dtype=np.int64)
            pools[task] = _Pool(ids, None, prompts, labels, empty)
        else:
            pools[task] = _Pool(ids, None, prompts, None, tuple(e.output for e in examples))
    return pools
