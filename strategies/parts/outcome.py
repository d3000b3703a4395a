"""What a round returns to the runner: per-phase reports and metrics, and the server's numbers.

A phase (training, or an evaluation) sends messages to some clients; its ``RoundReport`` says who
was sent one, whose reply was accepted (with its metrics), whose was rejected (and why) and who
is missing. ``PhaseOutcome`` adds the mean and population std of the accepted metrics;
``RoundOutcome`` is a training phase with the evaluation it carried (fused rounds) and the
strategy's own numbers of the round (``aggregate``'s return, e.g. pFedSeq's server step).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from flwr.app import MetricRecord

from fedfm_flower.records import protocol as P


@dataclass
class RoundReport:
    """What happened to the messages of one phase of a round (for the results log)."""

    sent: list[int] = field(default_factory=list)
    accepted: dict[int, dict[str, float]] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)  # client id or node -> reason

    @property
    def missing(self) -> list[int]:
        """Clients that were sent a message and neither replied validly nor were rejected."""
        return [c for c in self.sent if c not in self.accepted and str(c) not in self.rejected]


@dataclass(frozen=True)
class PhaseOutcome:
    """One phase's report and the mean (and std) of its accepted metrics (None: no reply)."""

    report: RoundReport
    metrics: MetricRecord | None

    @classmethod
    def of(cls, report: RoundReport) -> PhaseOutcome:
        """The outcome of a validated phase: its report and ``mean_metrics`` of it."""
        return cls(report, mean_metrics(report.accepted))


@dataclass(frozen=True)
class RoundOutcome:
    """A round's training phase, the evaluation it carried (None: none) and server metrics."""

    train: PhaseOutcome
    evaluation: PhaseOutcome | None
    server_metrics: dict[str, float]


def mean_metrics(per_client: dict[int, dict[str, float]]) -> MetricRecord | None:
    """Mean and population std of every per-client metric (identity metrics excluded)."""
    if not per_client:
        return None
    names = sorted({k for m in per_client.values() for k in m} - P.IDENTITY_METRICS)
    out: dict[str, float] = {}
    for name in names:
        values = [m[name] for m in per_client.values() if name in m]
        out[f"{name}-mean"] = _mean(values)
        out[f"{name}-std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
    out["num-clients"] = len(per_client)
    return MetricRecord(out)


def _mean(values: list[float]) -> float:
    """``statistics.fmean`` of finite ``values``; where their sum is beyond a float's range
    (values near 1.8e308), the sum of ``value / n`` instead, which is not."""
    try:
        return statistics.fmean(values)
    except OverflowError:
        return math.fsum(v / len(values) for v in values)
