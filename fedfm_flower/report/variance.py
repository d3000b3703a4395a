"""Which variance a setup's intervals carry: training alone, or data and training.

A seed varies the training (initialization, client sampling, batches); the data (the partition,
each client's test split, an offline foundation pretrained on it) come from the run's data seed
(``RunResult.data_seed``). Final runs that share one data draw (``data-seed`` the same for every
seed) give intervals over training variance only: they say how far another training run on the
same data could land, not another data draw. Runs that draw their data per seed (``data-seed``
-1, or a different one per seed) give intervals over both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedfm_flower.report.runs import RunResult


@dataclass(frozen=True)
class Draws:
    """The data draws of one setup's runs, by seed."""

    setup: str
    by_seed: dict[int, tuple[int, ...]]  # seed -> the data seeds its runs came from (sorted)

    @property
    def data_seeds(self) -> tuple[int, ...]:
        """The distinct data seeds of the setup's runs, sorted."""
        return tuple(sorted({d for drawn in self.by_seed.values() for d in drawn}))

    @property
    def variance(self) -> str:
        """``"training"`` (one data draw for every seed) or ``"data-and-training"``."""
        return "training" if len(self.data_seeds) == 1 else "data-and-training"

    @property
    def mixed_seeds(self) -> tuple[int, ...]:
        """Seeds whose runs came from different data draws (their methods' pairing is off)."""
        return tuple(seed for seed, drawn in self.by_seed.items() if len(drawn) > 1)

    def text(self) -> str:
        """The report's line under the setup's heading."""
        seeds = sorted(self.by_seed)
        if self.variance == "training":
            (data_seed,) = self.data_seeds
            line = (
                "Intervals carry training variance only (one data draw: data-seed "
                f"{data_seed} for every seed)."
            )
        elif not self.mixed_seeds and len(self.data_seeds) == len(seeds):
            drawn = ", ".join(str(self.by_seed[s][0]) for s in seeds)
            line = (
                "Intervals carry data and training variance (a data draw per seed: data-seeds "
                f"{drawn} for seeds {_listed(seeds)})."
            )
        else:
            drawn = "; ".join(f"seed {s}: {_listed(self.by_seed[s])}" for s in seeds)
            line = (
                f"Intervals carry data and training variance ({len(self.data_seeds)} data "
                f"draws over {len(seeds)} seeds: data-seeds {drawn})."
            )
        if self.mixed_seeds:
            line += (
                f" At seed{'s' if len(self.mixed_seeds) > 1 else ''} {_listed(self.mixed_seeds)} "
                "the methods' runs came from different data draws, so their paired differences "
                "compare data draws as well as methods."
            )
        return line

    def numbers(self) -> dict[str, Any]:
        """The setup's entry in report.json."""
        return {
            "variance": self.variance,
            "data-seeds": list(self.data_seeds),
            "by-seed": {str(seed): list(drawn) for seed, drawn in sorted(self.by_seed.items())},
        }


def data_draws(runs: Sequence[RunResult], setup: str) -> Draws:
    """The data draws of ``setup``'s runs; a run whose data seed was not read counts as drawn
    from its seed (``data-seed`` -1)."""
    by_seed: dict[int, set[int]] = {}
    for run in runs:
        if run.setup == setup:
            drawn = run.seed if run.data_seed is None else run.data_seed
            by_seed.setdefault(run.seed, set()).add(drawn)
    return Draws(setup, {seed: tuple(sorted(d)) for seed, d in sorted(by_seed.items())})


def _listed(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values)
