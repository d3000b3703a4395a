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

from fedfm_flower.data.flan import flan_client_split, flan_client_task
from fedfm_flower.data.instructions import build_corpus, client_split, client_task
from fedfm_flower.models.causal_lm import tokenizer_of
from fedfm_flower.models.language.encoding import encode_for_training, encode_prompts, references
from fedfm_flower.models.language.generate import generate
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

    def example_counts(self, config: ExperimentConfig, num_clients: int) -> list[ClientExamples]:
        """Train/test sizes of every client's split (no tokenizer needed)."""
        from fedfm_flower.data.sizes import ClientExamples

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
        if test.others:
            every_task = [scores, *(scores_on(examples) for examples in test.others)]
            for name in list(scores):
                scores[f"ttp-{name}"] = sum(s[name] for s in every_task) / len(every_task)
        return EvalStats(total_loss / max(tokens, 1), scores, len(test))
