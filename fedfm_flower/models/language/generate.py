"""Batched greedy decoding with a decoder-only model.

Prompts are padded on the left, so every prompt's last token sits in the last column and the new
tokens of a batch are generated in lockstep; the attention mask hides the padding and
``generate`` derives positions from it, so an answer does not depend on the batch it was in.
Greedy search (``do_sample=False``, one beam) makes the output deterministic, like FedDPA's
evaluation (``GlobalModel_generated.py`` decodes without sampling). Only the newly generated
tokens are decoded; special tokens are dropped and the text is stripped.

Imports inside functions keep ``torch`` out of this module's start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int,
    device: torch.device | str,
) -> list[str]:
    """Greedy continuations of ``prompts`` (new text only, stripped), ``batch_size`` at a time."""
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    outputs: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(
                prompts[start : start + batch_size], return_tensors="pt", padding=True
            )
            batch = {k: v.to(device) for k, v in batch.items() if k != "token_type_ids"}
            with torch.no_grad():
                tokens = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    num_beams=1,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            new = tokens[:, batch["input_ids"].shape[1] :]
            texts = tokenizer.batch_decode(new, skip_special_tokens=True)
            outputs.extend(text.strip() for text in texts)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return outputs
