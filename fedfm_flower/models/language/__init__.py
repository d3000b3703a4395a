"""The language stack below the task layer: tokenizer, encoding, generation, foundation LM.

Modules, one concept each: ``tokenizer`` (byte-level BPE trained on the offline instruction
corpus), ``encoding`` (prompt-masked training tensors, prompts and references), ``generate``
(batched greedy decoding), ``foundation`` (the tiny LLaMA pretrained on the public split and
cached, and a loader for real checkpoints). Importing this package is light: torch,
transformers and tokenizers load when a function that needs them is first called.
"""

from __future__ import annotations

from fedfm_flower import lazy_getattr

_EXPORTS = {
    "build_tokenizer": "fedfm_flower.models.language.tokenizer",
    "load_tokenizer": "fedfm_flower.models.language.tokenizer",
    "save_tokenizer": "fedfm_flower.models.language.tokenizer",
    "encode_for_training": "fedfm_flower.models.language.encoding",
    "encode_prompts": "fedfm_flower.models.language.encoding",
    "references": "fedfm_flower.models.language.encoding",
    "generate": "fedfm_flower.models.language.generate",
    "ensure_language_foundation": "fedfm_flower.models.language.foundation",
    "load_language_foundation": "fedfm_flower.models.language.foundation",
    "language_foundation_card": "fedfm_flower.models.language.foundation",
    "load_pretrained_causal_lm": "fedfm_flower.models.language.foundation",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
