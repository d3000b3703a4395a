"""The offline tokenizer: a byte-level BPE trained on the instruction corpus.

Byte-level BPE (GPT-2's pre-tokenizer and decoder) is used rather than a word-level vocabulary
for two reasons. Every string is a sequence of the 256 byte symbols, all in the vocabulary, so no
text can ever become ``<unk>`` (a client's data, a user's prompt, another seed's names); and
decoding restores the text exactly, spaces, newlines and punctuation included, which generation
and ROUGE need. The merges are trained on the whole generated corpus of the seed (every task, all
splits, responses included) plus the prompt template. So the vocabulary has seen the words of the
clients' test answers, as real foundation models' tokenizers saw text their users later
fine-tune and test on; it holds no pairing of a prompt with its answer. Measured at seed 0, a
tokenizer trained on the public split alone encodes a test answer in 4.39 tokens against 4.375
(every test answer's word also appears in public or training text), so the choice does not
change what the model can learn. With
a vocabulary as large as the corpus needs, nearly every word is one token, which keeps sequences
short for a tiny model. Training is deterministic for a given corpus (checked by the tests).

The result is wrapped as ``transformers.PreTrainedTokenizerFast`` with ``<pad>``, ``<s>``,
``</s>`` and ``<unk>``; it prepends ``<s>`` like LLaMA's tokenizer and pads on the left, as
batched generation with a decoder-only model requires. Training examples are built token by
token in ``encoding`` and padded on the right there.

Imports inside functions keep ``tokenizers`` and ``transformers`` out of this module's start-up.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from fedfm_flower.data.instructions import format_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from fedfm_flower.data.instructions import Example

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3
VOCAB_SIZE = 4096  # an upper bound: the trainer stops when no pair occurs twice
MODEL_MAX_LENGTH = 256


def corpus_texts(examples: Iterable[Example]) -> list[str]:
    """The texts the tokenizer is trained on: every prompt with its response."""

    return [format_prompt(e.instruction, e.input) + e.output for e in examples]


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``, wrapped for ``transformers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return wrap_tokenizer(tokenizer)


def wrap_tokenizer(tokenizer: object) -> PreTrainedTokenizerFast:
    """A ``tokenizers.Tokenizer`` as a left-padding ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(examples: Iterable[Example]) -> PreTrainedTokenizerFast:
    """The tokenizer for a corpus: byte-level BPE trained on its prompts and responses."""
    return train_tokenizer(corpus_texts(examples))


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    """Write ``tokenizer`` to ``directory`` (``tokenizer.json`` and its configuration)."""
    tokenizer.save_pretrained(str(directory))


def load_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved in ``directory``, left padding restored."""
    from transformers import PreTrainedTokenizerFast

    if not (Path(directory) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    tokenizer.padding_side = "left"
    return tokenizer
