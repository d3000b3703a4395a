"""Examples as tensors: prompt-masked causal-LM training data, generation prompts, references.

Loss masking follows FedDPA's official code (``code/main.py``, ``train_on_inputs=False``, the
default it runs with, inherited from alpaca-lora): the labels of the prompt are ``-100``, so the
loss covers the response and the ``</s>`` that ends it, and a model learns to answer rather than
to reproduce instructions. Padding is ``-100`` too. A sequence is ``<s>`` + prompt + response +
``</s>``; prompt and response are tokenized separately and concatenated, so the mask falls
exactly on the prompt/response boundary (with byte-level BPE the prompt ends in a newline, a
pre-token boundary, so this is the same as tokenizing the joined text; the tests check it).
Sequences longer than ``max_length`` are cut at the right, as FedDPA's ``cutoff_len`` does
(dropping the ``</s>``); shorter ones are padded on the right to exactly ``max_length``.

Imports inside functions keep ``torch`` out of this module's start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fedfm_flower.data.instructions import format_prompt

if TYPE_CHECKING:
    from torch.utils.data import TensorDataset
    from transformers import PreTrainedTokenizerBase

    from fedfm_flower.data.instructions import Example

IGNORE_INDEX = -100  # the label torch's cross-entropy skips


def prompt_and_response_ids(
    tokenizer: PreTrainedTokenizerBase, example: Example
) -> tuple[list[int], list[int]]:
    """Token ids of ``<s>`` + the prompt, and of the response + ``</s>``."""
    prompt = tokenizer(format_prompt(example.instruction, example.input))["input_ids"]
    response = tokenizer(example.output, add_special_tokens=False)["input_ids"]
    return list(prompt), [*response, tokenizer.eos_token_id]


def encoded_length(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example]) -> int:
    """The longest encoded example: a ``max_length`` that cuts nothing."""
    return max(sum(map(len, prompt_and_response_ids(tokenizer, e))) for e in examples)


def encode_for_training(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int
) -> TensorDataset:
    """(input_ids, attention_mask, labels), right-padded; labels only on response and EOS."""
    import torch
    from torch.utils.data import TensorDataset

    count = len(examples)
    input_ids = torch.full((count, max_length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((count, max_length), dtype=torch.long)
    labels = torch.full((count, max_length), IGNORE_INDEX, dtype=torch.long)
    for row, example in enumerate(examples):
        prompt, response = prompt_and_response_ids(tokenizer, example)
        ids = (prompt + response)[:max_length]
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, len(prompt) : len(ids)] = torch.tensor(ids[len(prompt) :], dtype=torch.long)
    return TensorDataset(input_ids, attention_mask, labels)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase | None, examples: Sequence[Example]
) -> list[str]:
    """The generation prompts (Table 7 template, no response); checked against the tokenizer's
    ``model_max_length`` when a tokenizer is given."""
    prompts = [format_prompt(e.instruction, e.input) for e in examples]
    if tokenizer is not None:
        limit = tokenizer.model_max_length
        for prompt in prompts:
            if len(tokenizer(prompt)["input_ids"]) >= limit:
                raise ValueError(f"prompt of over {limit} tokens: {prompt[:80]!r}...")
    return prompts


def references(examples: Sequence[Example]) -> list[str]:
    """The reference responses, in order, for ROUGE."""
    return [e.output for e in examples]
