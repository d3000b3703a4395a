"""Early stopping of bad tuning trials: Optuna's pruners, fed by a run's validation rounds.

A trial runs as a cell (``fedfm_flower.study.cells``), possibly in another process or on another Ray
node; its cell carries a ``TrialLink`` (the study's journal file, the study's name, the trial's
number, the pruner's settings). While the run goes, each round whose evaluation is complete (every
``eval-every`` rounds) reports the mean of the task's primary metric to the trial at step = the
round, through the journal, and asks the pruner whether to stop: a pruned run ends after that
round's checkpoint, its summary says ``stopped-at-round``, and the tuning command records the
trial as pruned (rounds run, last value). A round whose report cannot reach the journal (a file
system error, a lock not had, a line half written on a shared disk) is logged and not judged: the
run goes on to its next report, since a pruner that cannot be asked is no reason to lose the trial.

Pruners (``PrunerSettings.name``):

- ``halving``: asynchronous successive halving (``SuccessiveHalvingPruner``): at the rungs
  ``min_rounds x reduction^k`` a trial goes on only when its value is in the top
  ``1 / reduction`` of the values the study's trials had at that rung (the best of them while
  fewer than ``2 x reduction`` trials reached it);
- ``hyperband``: Hyperband (``HyperbandPruner``) over the same rungs, the largest resource being
  the rounds of the first trial that completed;
- ``none``: every trial runs all its rounds.

Imports inside functions keep ``optuna`` out of this module's start-up.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server_apps.runner import EarlyStop

PRUNERS: tuple[str, ...] = ("halving", "hyperband", "none")
DEFAULT_PRUNER = "halving"
DEFAULT_REDUCTION = 3

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrunerSettings:
    """Which pruner a study uses and its rungs (the same for every method of a table)."""

    name: str = DEFAULT_PRUNER
    min_rounds: int = 1  # the first rung, in rounds
    reduction: int = DEFAULT_REDUCTION  # 1 / reduction of the trials at a rung go on

    def __post_init__(self) -> None:
        if self.name not in PRUNERS:
            raise ValueError(f"--pruner '{self.name}' unknown; known: {', '.join(PRUNERS)}")
        if isinstance(self.min_rounds, bool) or not self.min_rounds >= 1:
            raise ValueError(f"--prune-min-rounds must be >= 1, got {self.min_rounds}")
        if isinstance(self.reduction, bool) or not self.reduction >= 2:
            raise ValueError(f"--prune-reduction must be >= 2, got {self.reduction}")

    def as_dict(self) -> dict[str, Any]:
        """The settings as ``tuning.json`` and the study's journal record them."""
        if self.name == "none":
            return {"name": "none"}
        return {key.replace("_", "-"): value for key, value in asdict(self).items()}

    def make(self) -> Any:
        """The Optuna pruner these settings describe."""
        import optuna

        if self.name == "halving":
            return optuna.pruners.SuccessiveHalvingPruner(
                min_resource=self.min_rounds, reduction_factor=self.reduction
            )
        if self.name == "hyperband":
            return optuna.pruners.HyperbandPruner(
                min_resource=self.min_rounds, reduction_factor=self.reduction
            )
        return optuna.pruners.NopPruner()


def journal_storage(path: Path) -> Any:
    """Optuna's journal storage in the file ``path`` (safe for several processes at once)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


PRUNED_AT = "fedfm-pruned-at"  # a trial user attr: the round its pruner said stop (the run stops)


@dataclass(frozen=True)
class TrialLink:
    """What a trial's run needs to report to its Optuna trial from wherever it runs."""

    journal: str  # the study's journal file (a path every node sees)
    study: str
    number: int
    pruner: PrunerSettings

    def early_stop(self) -> EarlyStop:
        """The run's early stop: report each evaluated round to the trial, then ask the pruner."""
        import optuna

        storage = journal_storage(Path(self.journal))
        study = optuna.load_study(
            study_name=self.study,
            storage=storage,
            sampler=optuna.samplers.RandomSampler(),  # samples nothing here
            pruner=self.pruner.make(),
        )
        study_id = storage.get_study_id_from_name(self.study)
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, self.number)
        trial = optuna.trial.Trial(study, trial_id)

        def stop(server_round: int, value: float) -> bool:
            try:
                return judge(server_round, value)
            except optuna.exceptions.UpdateFinishedTrialError:
                raise  # the trial was ended elsewhere: this run is not its run any more
            except (OSError, RuntimeError, ValueError) as err:  # the journal's, not the run's
                log.warning(
                    "trial %d of %s: round %d's value %.4g not reported to %s (%s: %s); "
                    "the run goes on unjudged until its next report",
                    self.number,
                    self.study,
                    server_round,
                    value,
                    self.journal,
                    type(err).__name__,
                    err,
                )
                return False

        def judge(server_round: int, value: float) -> bool:
            frozen = storage.get_trial(trial_id)
            if server_round not in frozen.intermediate_values:  # a resumed run reports again
                trial.report(value, server_round)
            if PRUNED_AT in frozen.user_attrs:  # decided before a crash: the resumed run stops
                return True
            prune = trial.should_prune()  # also records the rung the others are judged by
            # The enqueued setup values (trial 0) always run to the end, so the choice is
            # never worse on validation than the untuned run: with trials in parallel, a
            # faster drawn trial can reach a rung first and would prune it.
            prune = prune and "fixed_params" not in frozen.system_attrs
            if prune:  # at once: the rung is recorded, a resumed run would pass it by
                storage.set_trial_user_attr(trial_id, PRUNED_AT, server_round)
            return prune

        return stop
