"""ROUGE-1, ROUGE-2 and ROUGE-L of generated responses against references.

FedDPA reports ROUGE (ROUGE-1 in its tables). Its official ``code/metric.py`` scores with T5's
``metrics.rouge``: Google's ``rouge_score`` with the Porter stemmer, types rouge1, rouge2 and
rougeLsum, F-measure, aggregated over examples (a bootstrap mean) and scaled to 0-100. Here the
same scorer (``use_stemmer=True``) gives the F-measure per example, and the plain mean over
examples is reported in [0, 1]. ROUGE-L is ``rougeL`` (longest common subsequence over the whole
text) rather than ``rougeLsum`` (the same per newline-separated sentence, then unioned): the
responses here are single lines, on which the two coincide, and ``rougeL`` does not depend on how
a model happens to break lines. FedDPA's best-over-several-references step does not apply (one
reference per example).

Imports inside functions keep ``rouge_score`` out of this module's start-up.
"""

from __future__ import annotations

from collections.abc import Sequence

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
ROUGE_KEYS = {"rouge1": "rouge-1", "rouge2": "rouge-2", "rougeL": "rouge-l"}


def rouge_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F-measures in [0, 1], keyed ``rouge-1``, ``rouge-2``, ``rouge-l``."""
    from rouge_score import rouge_scorer

    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise ValueError("no predictions to score")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for prediction, reference in zip(predictions, references, strict=True):
        scores = scorer.score(reference, prediction)  # (target, prediction)
        for kind in ROUGE_TYPES:
            totals[kind] += scores[kind].fmeasure
    return {ROUGE_KEYS[kind]: totals[kind] / len(predictions) for kind in ROUGE_TYPES}
