"""Instruction following: causal-LM loss on the response, ROUGE of greedy generations.

A client's data are instruction examples (``fedfm_flower.data.instructions``, one task per
client by default, as FedDPA's federated Flan sets), put in FedDPA's prompt template (its
Table 7) and tokenized by the model's tokenizer. Training minimises the cross-entropy of the
response tokens (and EOS) given the prompt; the prompt and the padding carry no loss
(``fedfm_flower.models.language.encoding``). Evaluation generates a greedy response of at most
``max-new-tokens`` tokens for every test prompt, in batches of ``batch-size`` with left
padding, and scores it against the reference with ROUGE-1/2/L F-measures in [0, 1]
(``fedfm_flower.tasks.metrics.rouge``); ROUGE-1 is the primary metric, FedDPA's headline (its Tables
1-2). The test loss is the same response cross-entropy as in training, per response token.

With ``test-time-evaluation`` a client also answers the test examples of every other task in
the federation (all clients' test splits of that task) with its own model: FedDPA's test-time
personalization. ``ttp-rouge-1`` (and ``-2``, ``-l``) is the mean over all tasks, the client's
own included, each task weighing the same, as the paper averages "all tasks including
test-time tasks" (sec. 5.2).

Test-time tasks outside the federation (FedDPA's Table 14: trained on dataset 1, tested on three
of dataset 2's tasks): with ``test-time-evaluation``, ``unseen-test-dir`` names a directory of
``flan``-format test files (``fedfm_flower.data.flan.flan_unseen_tests``: a file's task is its
records' most common ``category``, else the file's name), and for the offline ``instructions``
data ``unseen-tasks`` names tasks no client holds. Each client answers every unseen task's test
examples with its own model (the test-time personalized model of the ``ttp-*`` metrics) and
reports ``unseen-<task>-rouge-1`` (and ``-2``, ``-l``; ``records.protocol.unseen_metric``) per
task; they do not enter ``ttp-*``. They are read at the test split's evaluation only (none with
``evaluation-split = "val"``).

Imports inside functions keep ``numpy`` out of this module's start-up.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedfm_flower.data.flan import flan_client_split, flan_client_task, flan_unseen_tests
from fedfm_flower.data.instructions import (
    INSTRUCTION_TASKS,
    build_corpus,
    client_split,
    client_task,
)
from fedfm_flower.models.causal_lm import tokenizer_of
from fedfm_flower.models.language.encoding import encode_for_training, encode_prompts, references
from fedfm_flower.models.language.generate import generate
from fedfm_flower.records import protocol as P
from fedfm_flower.tasks.base import Batch, EvalStats, StepResult, Task
from fedfm_flower.tasks.classification import tensor_batches
from fedfm_flower.tasks.metrics.rouge import rouge_scores

if TYPE_CHECKING:
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.data.instructions import Corpus, Example
    from fedfm_flower.data.sizes import ClientExamples


@dataclass(frozen=True)
class InstructionData:
    """One client's instruction data: encoded training rows and the test examples."""

    train: TensorDataset  # (input_ids, attention_mask, labels), right-padded
    test: InstructionTest
    task: str  # the instruction task of this client
    val: InstructionTest | None = None  # None when val-fraction is 0


@dataclass(frozen=True)
class InstructionTest:
    """Test examples, their encoded rows (for the loss) and the generation settings."""

    examples: tuple[Example, ...]
    encoded: TensorDataset
    max_new_tokens: int
    batch_size: int
    others: tuple[tuple[Example, ...], ...] = ()  # other tasks' test examples, one per task
    # (task, test examples) of every test-time task outside the federation
    unseen: tuple[tuple[str, tuple[Example, ...]], ...] = ()

    def __len__(self) -> int:
        return len(self.examples)


def trimmed_batches(
    data: TensorDataset, batch_size: int, generator: torch.Generator | None
) -> Iterator[Batch]:
    """(input_ids, attention_mask, labels) batches cut to their longest row (right padding)."""
    for input_ids, attention_mask, labels in tensor_batches(data, batch_size, generator):
        length = int(attention_mask.sum(1).max())
        yield input_ids[:, :length], attention_mask[:, :length], labels[:, :length]


@functools.lru_cache(maxsize=2)
def _corpus(seed: int) -> Corpus:
    """The instruction corpus of ``seed``, built once per process (read-only by its users)."""

    return build_corpus(seed)


class InstructionFollowing(Task):
    """Follow instructions; metrics: ROUGE-1, ROUGE-2, ROUGE-L (primary)."""

    name = "instruction-following"
    primary_metric = "rouge-1"
    modality = "text"

    def _splits(
        self, config: ExperimentConfig, partition_id: int, num_partitions: int
    ) -> tuple[tuple[Example, ...], tuple[Example, ...], tuple[Example, ...]]:
        """(train, test, validation) of a client: the source's train and test split, and
        ``val-fraction`` of the client's examples drawn out of its train split (seeded; the test
        split does not depend on it; validation empty when ``val-fraction`` is 0)."""
        train, test = self._source_splits(config, partition_id, num_partitions)
        if config.val_fraction <= 0 or not train:
            return train, test, ()
        size = max(1, math.floor(config.val_fraction * (len(train) + len(test))))
        order = list(range(len(train)))
        seed = config.effective_data_seed
        random.Random(f"fedfm-instructions-val:{seed}:{partition_id}").shuffle(order)
        val = set(order[:size])
        kept = tuple(e for i, e in enumerate(train) if i not in val)
        return kept, test, tuple(train[i] for i in sorted(val))

    def _source_splits(
        self, config: ExperimentConfig, partition_id: int, num_partitions: int
    ) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
        if config.dataset == "flan":  # FedDPA's Flan files under data-dir (or a Hub id)
            return flan_client_split(config.data_dir, partition_id, num_partitions)

        return client_split(
            _corpus(config.effective_data_seed),
            partition_id,
            num_partitions,
            config.public_fraction,
            config.test_fraction,
            config.effective_data_seed,
        )

    def client_data(
        self, config: ExperimentConfig, partition_id: int, num_partitions: int
    ) -> InstructionData:
        """The client's examples, encoded with the configured model's tokenizer."""

        train, test, val = self._splits(config, partition_id, num_partitions)
        tokenizer = tokenizer_of(config)

        def evaluation_split(examples: tuple[Example, ...], which: int) -> InstructionTest:
            return InstructionTest(
                examples,
                encode_for_training(tokenizer, examples, config.max_length),
                config.max_new_tokens,
                config.batch_size,
                self._other_tasks_tests(config, partition_id, num_partitions, which),
                self._unseen_tests(config, num_partitions) if which == 1 else (),
            )

        return InstructionData(
            encode_for_training(tokenizer, train, config.max_length),
            evaluation_split(test, 1),
            self._client_task(config, partition_id),
            evaluation_split(val, 2) if config.val_fraction > 0 else None,
        )

    def _client_task(self, config: ExperimentConfig, partition_id: int) -> str:
        if config.dataset == "flan":  # the category of the client's file
            return flan_client_task(config.data_dir, partition_id)

        return client_task(partition_id)

    def client_labels(self, config: ExperimentConfig, num_clients: int) -> dict[str, str]:
        """{client id: its instruction task} (the columns of FedDPA's Table 1)."""
        return {str(p): self._client_task(config, p) for p in range(num_clients)}

    def _other_tasks_tests(
        self, config: ExperimentConfig, partition_id: int, num_partitions: int, which: int = 1
    ) -> tuple[tuple[Example, ...], ...]:
        """Every other task's test examples (all its clients'; ``which`` = 2: their validation
        examples), when test-time evaluation is on."""
        if not config.test_time_evaluation:
            return ()
        tests = [self._splits(config, p, num_partitions)[which] for p in range(num_partitions)]
        own = {e.task for e in tests[partition_id]}
        by_task: dict[str, list[Example]] = {}
        for test in tests:
            for example in test:
                if example.task not in own:
                    by_task.setdefault(example.task, []).append(example)
        return tuple(tuple(by_task[task]) for task in sorted(by_task))

    def _unseen_tests(
        self, config: ExperimentConfig, num_partitions: int
    ) -> tuple[tuple[str, tuple[Example, ...]], ...]:
        """(task, test examples) of every test-time task outside the federation, when test-time
        evaluation is on: ``unseen-test-dir``'s files (``flan_unseen_tests``) and the offline
        ``unseen-tasks``, each the test split its client would hold among 8 clients (one per
        task). A task of the federation's clients is refused."""
        if not config.test_time_evaluation:
            return ()
        unseen = list(flan_unseen_tests(config.unseen_test_dir)) if config.unseen_test_dir else []
        for task in config.unseen_task_names:
            if task not in INSTRUCTION_TASKS:
                raise ValueError(
                    f"run config 'unseen-tasks' = {config.unseen_tasks!r}: no offline task "
                    f"{task!r}; known: {', '.join(INSTRUCTION_TASKS)}"
                )
            corpus, tasks = _corpus(config.effective_data_seed), len(INSTRUCTION_TASKS)
            position = INSTRUCTION_TASKS.index(task)
            test = client_split(
                corpus,
                position,
                tasks,
                config.public_fraction,
                config.test_fraction,
                config.effective_data_seed,
            )[1]
            unseen.append((task, test))
        federation = {self._client_task(config, p): p for p in reversed(range(num_partitions))}
        names = [task for task, _ in unseen]
        for task in names:
            if task in federation or names.count(task) > 1:
                why = (
                    f"is client {federation[task]}'s task"
                    if task in federation
                    else "is named by both unseen-test-dir and unseen-tasks"
                )
                raise ValueError(
                    f"run config 'unseen-test-dir' / 'unseen-tasks': unseen task {task!r} {why}; "
                    "an unseen task is none of the federation's, each once (clients take the "
                    "offline tasks in turn: fewer clients leave some unseen)"
                )
        return tuple(sorted(unseen))

    def example_counts(self, config: ExperimentConfig, num_clients: int) -> list[ClientExamples]:
        """Train/test sizes of every client's split (no tokenizer needed); the unseen tasks
        are read here too, so that preflight refuses bad ones before any run."""
        from fedfm_flower.data.sizes import ClientExamples

        self._unseen_tests(config, num_clients)
        counts = []
        for client in range(num_clients):
            train, test, val = self._splits(config, client, num_clients)
            counts.append(ClientExamples(len(train), len(test), len(val)))
        return counts

    def batches(
        self, data: Any, batch_size: int, generator: torch.Generator | None
    ) -> Iterator[Batch]:
        """Training batches cut to their longest row."""
        return trimmed_batches(data, batch_size, generator)

    def step(self, model: nn.Module, batch: Batch) -> StepResult:
        """Mean cross-entropy of the batch's response tokens."""
        input_ids, attention_mask, labels = batch
        loss = model(input_ids, attention_mask, labels).loss
        return StepResult(loss, len(input_ids))

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, data: Any, device: torch.device, batch_size: int
    ) -> EvalStats:
        """Response cross-entropy per token and ROUGE-1/2/L of greedy generations."""

        model.eval()
        test: InstructionTest = data
        total_loss, tokens = 0.0, 0
        for batch in trimmed_batches(test.encoded, test.batch_size, None):
            input_ids, attention_mask, labels = (t.to(device) for t in batch)
            count = int((labels[:, 1:] != -100).sum())
            if count:
                loss = model(input_ids, attention_mask, labels).loss
                total_loss += loss.item() * count
                tokens += count

        def scores_on(examples: tuple[Example, ...]) -> dict[str, float]:
            prompts = encode_prompts(None, examples)
            answers = generate(
                model, model.tokenizer, prompts, test.max_new_tokens, test.batch_size, device
            )
            return rouge_scores(answers, references(examples))

        scores = scores_on(test.examples)
        names = list(scores)
        if test.others:
            every_task = [scores, *(scores_on(examples) for examples in test.others)]
            for name in names:
                scores[f"ttp-{name}"] = sum(s[name] for s in every_task) / len(every_task)
        for task, examples in test.unseen:
            for name, value in scores_on(examples).items():
                scores[P.unseen_metric(task, name)] = value
        return EvalStats(total_loss / max(tokens, 1), scores, len(test))
