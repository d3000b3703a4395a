"""Choosing a study's values: its top trials re-run at more seeds, scored late and over seeds.

A trial's single-seed score (its final validation value at the tuning seed) rewards the edge of
stability: a learning rate that reaches the best value at one seed may diverge at the next
(FedRep's on the glyph label-skew table did at test seed 2). The tuning command therefore
chooses so (``Selection``):

1. **Candidates**: the ``top`` complete trials by single-seed score whose own run did not
   diverge (lowest trial number first among equals).
2. **Re-runs**: each candidate runs again at every ``seeds`` training seed on the trials' data
   and validation split (``data-seed`` = the trials', ``evaluation-split = val``), test sealed.
3. **Divergence**: a run diverged when one of its evaluated values is not finite, or an
   evaluated round after its best falls more than ``drop`` (a share of the best value) below
   the best; a run that failed (a NaN loss stops a run) counts as diverged. A candidate with a
   diverged run, at any seed, cannot be chosen.
4. **Score**: the mean over the candidate's runs (the trial's own and its re-runs) of the mean
   over each run's last ``last_rounds`` evaluated rounds: a value reached once, at the last
   round of one seed, counts for less than one held over rounds and seeds.
5. **Choice**: the stable candidate of the highest score. When every candidate of a wave is
   unstable, the next ``top`` trials by single-seed score form the next wave, until one is
   stable or no complete trial is left (then the study has no choice, and no final runs).

With ``top = 0`` nothing re-runs: the choice is the complete trial of the best single-seed
score whose run did not diverge (the selection before this module, with the divergence guard).
The re-runs' client-rounds count in the study's budget (``tune``: a study under
``--client-rounds`` leaves room for one wave, ``reserve``). Every decision is recomputed from
the runs' ``metrics.jsonl``, so a resumed command, on this machine or another, decides alike.
Light: no torch, no optuna.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_TOP = 3
DEFAULT_EXTRA_SEEDS = 2  # re-run seeds after the tuning seed
DEFAULT_LAST_ROUNDS = 2
DEFAULT_DROP = 0.1


@dataclass(frozen=True)
class SelectionSettings:
    """How a study chooses: ``top`` candidates per wave, re-run at ``seeds``, scored over their
    ``last_rounds`` evaluated rounds, a run diverged below ``(1 - drop)`` x its best."""

    top: int = DEFAULT_TOP
    seeds: tuple[int, ...] = (1, 2)
    last_rounds: int = DEFAULT_LAST_ROUNDS
    drop: float = DEFAULT_DROP

    def check(self, tune_seed: int) -> None:
        """A ``ValueError`` naming the option and value that cannot select."""
        if self.top < 0:
            raise ValueError(f"--select-top must be >= 0, got {self.top}")
        if self.top > 0 and not self.seeds:
            raise ValueError("--select-seeds: a re-run needs at least one seed (or --select-top 0)")
        if len(set(self.seeds)) != len(self.seeds) or tune_seed in self.seeds:
            raise ValueError(
                f"--select-seeds {' '.join(map(str, self.seeds))}: the seeds must differ from "
                f"each other and from the tuning seed {tune_seed} (its run is the trial's own)"
            )
        if self.last_rounds < 1:
            raise ValueError(f"--select-last-rounds must be >= 1, got {self.last_rounds}")
        if not 0.0 < self.drop < 1.0:
            raise ValueError(f"--diverge-drop must lie in (0, 1), got {self.drop}")

    def reruns(self) -> int:
        """The re-runs of one wave (``top`` x the re-run seeds)."""
        return self.top * len(self.seeds) if self.top > 0 else 0

    def as_dict(self) -> dict[str, Any]:
        """The settings as ``tuning.json`` records them."""
        return {
            "top": self.top,
            "seeds": list(self.seeds),
            "last-rounds": self.last_rounds,
            "drop": self.drop,
        }

    def describe(self) -> str:
        """One sentence of how the choice is made (the report's and ``tuning.json``'s)."""
        if self.top == 0:
            return (
                "final mean client value of the primary metric on the validation split, at "
                f"the tuning seed; a run that diverged (a round {self.drop:.0%} below its best, "
                "or not finite) is not chosen"
            )
        return (
            f"the top {self.top} trials by final validation value re-run at seeds "
            f"{', '.join(map(str, self.seeds))} on the trials' data; chosen by the mean over "
            f"seeds of the mean over the last {self.last_rounds} evaluated rounds, among "
            f"those no run of which diverged (a round {self.drop:.0%} below its best, or not "
            "finite)"
        )


def evaluated_values(run_dir: Path, metric: str) -> list[float]:
    """The mean client value of ``metric`` at each evaluated round of the run at ``run_dir``
    (its ``metrics.jsonl``: ``test-<metric>-mean``, the evaluated split's), in round order;
    none when the run wrote no rounds."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    key = f"test-{metric}-mean"
    values = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if key in record:
                value = record[key]
                values.append(math.nan if value is None else float(value))
    return values


def diverged(values: Sequence[float], drop: float) -> bool:
    """Whether a run's evaluated ``values`` diverged: one not finite, or one after the best
    more than ``drop`` x the best below it."""
    if not all(math.isfinite(v) for v in values):
        return True
    if not values:
        return False
    best_at = max(range(len(values)), key=lambda i: values[i])
    floor = values[best_at] - drop * abs(values[best_at])
    return any(v < floor for v in values[best_at + 1 :])


def tail_mean(values: Sequence[float], last: int) -> float:
    """The mean of the last ``last`` of ``values`` (all of them when fewer); NaN when none."""
    tail = list(values[-last:])
    return sum(tail) / len(tail) if tail else math.nan


@dataclass(frozen=True)
class RunOutcome:
    """One run of a candidate: its seed, its evaluated values, and what selection reads."""

    seed: int
    run: str
    values: tuple[float, ...]
    failed: bool  # the run ended without its summary (a crash, a NaN loss)
    diverged: bool
    tail: float

    def as_dict(self) -> dict[str, Any]:
        """The outcome as ``tuning.json`` records it."""
        return {
            "seed": self.seed,
            "run": self.run,
            "tail": None if not math.isfinite(self.tail) else self.tail,
            "failed": self.failed,
            "diverged": self.diverged,
        }


def outcome_of(
    run_dir: Path,
    seed: int,
    metric: str,
    settings: SelectionSettings,
    scored: float | None = None,
) -> RunOutcome:
    """What selection reads from the ended run at ``run_dir`` (at ``seed``). A trial's own
    run comes with the final value its study ``scored``: it completed, and where its rounds
    are not on disk (a pool that keeps none) that value stands for them."""
    values = evaluated_values(run_dir, metric)
    if scored is not None:
        values = values or [scored]
        failed = False
    else:
        failed = not (run_dir / "summary.json").is_file() or not values
    return RunOutcome(
        seed,
        str(run_dir),
        tuple(values),
        failed,
        failed or diverged(values, settings.drop),
        tail_mean(values, settings.last_rounds),
    )


@dataclass
class Candidate:
    """A trial in the running for the choice: its values, its single-seed score and its runs'
    outcomes by seed (the trial's own at the tuning seed included)."""

    trial: int
    params: dict[str, Any]
    single: float  # the trial's final validation value at the tuning seed
    outcomes: dict[int, RunOutcome] = field(default_factory=dict)

    @property
    def stable(self) -> bool:
        """No run of it diverged or failed."""
        return not any(o.diverged for o in self.outcomes.values())

    @property
    def score(self) -> float:
        """The mean over its runs of their tail means (NaN when unstable or without runs)."""
        if not self.stable or not self.outcomes:
            return math.nan
        return sum(o.tail for o in self.outcomes.values()) / len(self.outcomes)

    def as_dict(self) -> dict[str, Any]:
        """The candidate as ``tuning.json`` records it."""
        score = self.score
        return {
            "trial": self.trial,
            "values": dict(self.params),
            "single-seed-score": self.single,
            "runs": [self.outcomes[s].as_dict() for s in sorted(self.outcomes)],
            "stable": self.stable,
            "score": score if math.isfinite(score) else None,
        }


@dataclass(frozen=True)
class ScoredTrial:
    """A complete trial as selection sees it: number, values, single-seed score, its run."""

    number: int
    params: dict[str, Any]
    value: float
    run_dir: Path


class Selection:
    """One study's choice, wave by wave (the module docstring): ``start`` with the study's
    complete trials, run every ``wanted`` re-run and hand each back to ``take``; ``chosen``
    is set once decided (None with ``decided`` when no trial is stable)."""

    def __init__(self, settings: SelectionSettings, tune_seed: int, metric: str) -> None:
        self.settings = settings
        self.tune_seed = tune_seed
        self.metric = metric
        self.candidates: list[Candidate] = []
        self.passed_over: list[int] = []  # complete trials whose own run diverged
        self.waves = 0
        self.decided = False
        self.chosen: Candidate | None = None
        self._queue: list[ScoredTrial] = []
        self._wave: list[Candidate] = []
        self._wanted: list[tuple[Candidate, int]] = []  # (candidate, seed) still to run

    def start(self, trials: Sequence[ScoredTrial]) -> None:
        """Rank the study's complete ``trials`` and open the first wave (or decide, with
        ``top = 0``)."""
        ranked = sorted(trials, key=lambda t: (-t.value, t.number))
        self._queue = []
        for trial in ranked:
            own = self._own(trial)
            if own.diverged:
                self.passed_over.append(trial.number)
            else:
                self._queue.append(trial)
        if self.settings.top == 0:
            best = self._queue[0] if self._queue else None
            self.decided = True
            if best is not None:
                self.chosen = Candidate(best.number, best.params, best.value)
                self.candidates = [self.chosen]
            return
        self._next_wave()

    def _next_wave(self) -> None:
        wave, self._queue = self._queue[: self.settings.top], self._queue[self.settings.top :]
        if not wave:
            self.decided = True  # no stable trial is left: no choice
            return
        self.waves += 1
        self._wave = []
        for trial in wave:
            candidate = Candidate(trial.number, trial.params, trial.value)
            candidate.outcomes[self.tune_seed] = self._own(trial)
            self.candidates.append(candidate)
            self._wave.append(candidate)
            self._wanted += [(candidate, seed) for seed in self.settings.seeds]

    def _own(self, trial: ScoredTrial) -> RunOutcome:
        return outcome_of(trial.run_dir, self.tune_seed, self.metric, self.settings, trial.value)

    def wanted(self) -> list[tuple[int, dict[str, Any], int]]:
        """The re-runs the current wave still needs: (trial number, values, seed)."""
        return [(c.trial, c.params, seed) for c, seed in self._wanted]

    def take(self, trial: int, seed: int, run_dir: Path) -> None:
        """Read the ended re-run of ``trial`` at ``seed`` from ``run_dir``; decide once the
        wave has every run (or open the next wave when none of it is stable)."""
        for i, (candidate, wanted_seed) in enumerate(self._wanted):
            if candidate.trial == trial and wanted_seed == seed:
                del self._wanted[i]
                candidate.outcomes[seed] = outcome_of(run_dir, seed, self.metric, self.settings)
                break
        else:
            raise ValueError(f"no re-run of trial {trial} at seed {seed} is wanted")
        if self._wanted:
            return
        stable = [c for c in self._wave if c.stable]
        if not stable:
            self._next_wave()
            return
        self.decided = True
        self.chosen = max(stable, key=lambda c: (c.score, c.single, -c.trial))

    def candidates_outcome(self, trial: int, seed: int) -> str:
        """A progress line's text of the run of candidate ``trial`` at ``seed``."""
        candidate = next(c for c in self.candidates if c.trial == trial)
        run = candidate.outcomes[seed]
        if run.failed:
            return "failed: cannot be chosen"
        said = f"val {self.metric} over the last {self.settings.last_rounds} rounds {run.tail:.4f}"
        return said + (" (diverged: cannot be chosen)" if run.diverged else "")

    def verdict(self) -> str:
        """A progress line's text of the decision."""
        if self.chosen is None:
            return "no stable trial: no choice, no final runs"
        chosen = self.chosen
        if self.settings.top == 0:
            return f"chose trial {chosen.trial} (val {self.metric} {chosen.single:.4f})"
        return (
            f"chose trial {chosen.trial}: val {self.metric} {chosen.score:.4f} over seeds "
            f"{', '.join(map(str, sorted(chosen.outcomes)))} (single-seed {chosen.single:.4f})"
        )

    def record(self) -> dict[str, Any]:
        """What ``tuning.json`` says of the selection."""
        return {
            **self.settings.as_dict(),
            "waves": self.waves,
            "decided": self.decided,
            "chosen-trial": None if self.chosen is None else self.chosen.trial,
            "passed-over": list(self.passed_over),
            "candidates": [c.as_dict() for c in self.candidates],
        }
