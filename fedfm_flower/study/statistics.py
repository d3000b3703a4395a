"""Confidence intervals and paired tests for results over seeds and clients."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Mean and the half-width of its Student-t confidence interval (0 for one value)."""
    if not values:
        raise ValueError("mean_ci needs at least one value")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"mean_ci needs finite values, got {list(values)[:5]}")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    sem = statistics.stdev(values) / math.sqrt(len(values))
    return mean, float(stats.t.ppf(0.5 + confidence / 2, len(values) - 1)) * sem


@dataclass(frozen=True)
class PairedTest:
    """A paired comparison a - b over matched units (seeds, or (seed, client) pairs)."""

    n: int
    mean_difference: float
    ci_half_width: float
    p_value: float

    def significant(self, alpha: float = 0.05) -> bool:
        """Whether the two-sided paired t-test rejects 'no difference' at ``alpha``."""
        return self.p_value < alpha


def paired_test(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> PairedTest:
    """Two-sided paired t-test of a - b; units must be in the same order in both."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(
            f"paired_test needs two equal-length samples of >= 2, got {len(a)}, {len(b)}"
        )
    if not all(math.isfinite(v) for v in (*a, *b)):
        raise ValueError("paired_test needs finite values")
    differences = [x - y for x, y in zip(a, b, strict=True)]
    mean, half = mean_ci(differences, confidence)
    if all(d == differences[0] for d in differences):
        p_value = 1.0 if differences[0] == 0 else 0.0
    else:
        p_value = float(stats.ttest_rel(a, b).pvalue)
    return PairedTest(len(differences), mean, half, p_value)
