"""Tuning: every method searched with the same budget on validation data, then run over seeds.

    python -m fedfm_flower.tune --methods fedavg fedprox fedrep --setups digits-label-skew \\
        --trials 12 --seeds 0 1 2 --out runs/tuned [--ray | --ray-address auto]
    python -m fedfm_flower.report runs/tuned --out reports/tuned

For each (method label, setup) pair, an Optuna study (TPE by default, or random search) draws
``--trials`` hyperparameter settings from the method's declared space
(``fedfm_flower.study.search``: the common training keys and the method's own). Each trial is one
run of the setup at the tuning seed with ``evaluation-split = val``: clients evaluate on their
validation split (the setup's ``val-fraction``, or ``--val-fraction`` of each client's training
examples when the setup holds none: ``val_share``) and their test split is sealed,
so nothing read during tuning comes from test data. A trial's score is the final mean
validation value of the task's primary metric; a run that fails or diverges (NaN) counts
against the budget as a failed trial. Each evaluated round reports its value to the trial, and
the ``--pruner`` (``fedfm_flower.study.pruning``: successive halving by default, the same settings
for every study of a setup) stops a trial that falls behind: a pruned trial counts against the
budget with the rounds it ran. The best trial's values then run at every ``--seeds``
seed on the test split, on the trials' data (``data-seed`` = the tuning seed, same
``val-fraction``): the seed varies the training alone, every final run trains on the trials'
training examples and none tests on an example the trials validated on (with the data drawn
per seed, about 70% of the trials' validation examples of a glyph setup fell in another seed's
test split). They write into ``<out>/runs`` with ``<out>/sweep.json``: the report over
``<out>`` is the tuned table.

``<out>/tuning.json`` holds, per study, the searched space, the pruner, every trial (values,
score, state, run directory, rounds and client-rounds run, a pruned trial's last value), the
ranges of values tried, the chosen values and what the study spent (trials, pruned ones,
rounds, client-rounds, seconds), and the commands' wall time; ``<out>/tuning/`` holds the
trials' runs. The studies' Optuna journal, ``tuning.json`` and every finished run's small files
live under ``--state`` (``fedfm_flower.study.state``; by default ``<out>``), so a copy of that
directory alone resumes on another machine; the runs of one setup, trials and final runs,
must have run on one foundation model (``fedfm_flower.study.grid_foundations``: a run on another
stops the command). Rerunning the command resumes: finished trials
and runs are kept, a trial that was running is rerun from its checkpoint, and only the missing
trials are drawn. Trials and
final runs are cells of a pool (``fedfm_flower.study.pools``): serial, or parallel Ray tasks; with
TPE, parallel trials are drawn before all earlier ones are scored (Optuna's constant liar), so the
drawn values depend on the finishing order, while random search draws the same values either way.
A study's final runs start as soon as its last trial has ended, in the slots no trial is left to
take: a slow study's last trials do not leave the pool idle, and an interrupted command has the
finished studies' final runs.

With ``--variants-at-parent`` a ``method:variant`` label (a paper's ablation) gets no study: its
final runs use the values chosen for ``method``, except the keys its variant file sets, so it
differs from the method's final runs in the ablated part alone and costs no trials. A study's
sampler is seeded from ``--tune-seed``, its method label and the count of trials it drew
(``sampler_seed``): each method draws its own points, the same on every machine, and a resumed
study draws new values instead of replaying the first command's.

Imports inside functions keep ``optuna`` out of this module's start-up.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
import tomllib
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.config.overrides import parse_overrides
from fedfm_flower.methods.settings import require_package
from fedfm_flower.records.durable import atomic_write_text
from fedfm_flower.records.logs import configure_logging
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.study.cells import TRANSFER_MARK, Cell, cell_kind, cell_state, runs_of
from fedfm_flower.study.grid_foundations import SetupFoundations, run_data_seed
from fedfm_flower.study.pools import CellPool
from fedfm_flower.study.pruning import (
    DEFAULT_PRUNER,
    DEFAULT_REDUCTION,
    PRUNERS,
    PrunerSettings,
    TrialLink,
    journal_storage,
)
from fedfm_flower.study.search import (
    Resolved,
    describe,
    method_space,
    resolve_space,
    setup_values,
    suggest,
    tried_ranges,
)
from fedfm_flower.study.selection import (
    DEFAULT_DROP,
    DEFAULT_EXTRA_SEEDS,
    DEFAULT_LAST_ROUNDS,
    DEFAULT_TOP,
    ScoredTrial,
    Selection,
    SelectionSettings,
)
from fedfm_flower.study.state import StudyState, cache_dir_of, read_tuning
from fedfm_flower.study.sweep import (
    CONFIG_ROOT,
    SweepLog,
    TimeLeft,
    add_grid_arguments,
    cell_config,
    check_configs,
    pool_from_arguments,
    run_grid,
    run_name,
    variant_settings,
)

SAMPLERS: tuple[str, ...] = ("tpe", "random")
DEFAULT_VAL_FRACTION = 0.15
DEFAULT_SEEDS: tuple[int, ...] = (0, 1, 2, 3, 4)  # final runs, each on its own data draw
TRANSFER_ROOT = "transfer"  # configs/transfer/<setup>/<name>.toml: a setup no trial saw
ENDED_STATES: tuple[str, ...] = ("COMPLETE", "PRUNED", "FAIL")  # count against the budget


@dataclass
class Study:
    """One (method label, setup) search: its base run config, its space, its Optuna study."""

    label: str
    setup: str  # the setup file's name (without the tag)
    tag: str
    base: dict[str, Any]  # the tuning seed's run config, evaluation-split = val
    space: dict[str, Resolved]
    optuna_study: Any
    trials: int  # the budget
    finished: int = 0  # trials scored, pruned or failed (they count against the budget)
    ablations: list[str] = field(default_factory=list)  # method:variant labels run at its values
    running: dict[Path, int] = field(default_factory=dict)  # run directory -> trial number
    pruner: PrunerSettings = field(default_factory=lambda: PrunerSettings("none"))
    journal: Path | None = None  # where the trials' runs report (None: they do not report)
    client_rounds: int = 0  # the budget in client-rounds besides ``trials`` (0: none)
    spent: int = 0  # client-rounds of the ended trials
    full_trial: int = 0  # most client-rounds an ended trial ran (0: none ended yet)
    select: SelectionSettings = field(default_factory=lambda: SelectionSettings(top=0))
    selection: Selection | None = None  # opened once every trial has ended
    selecting: dict[Path, tuple[int, int]] = field(default_factory=dict)  # re-run -> trial, seed
    reruns: deque[Cell] = field(default_factory=deque)  # re-runs waiting for a slot

    @property
    def name(self) -> str:
        """The Optuna study name (one journal holds every study of the directory)."""
        return study_name(self.label, self.setup, self.tag)

    def left(self) -> int:
        """Trials still to draw: those of the trial budget; then, under a client-round budget,
        as many as its client-rounds not yet spent take, counting each running trial as one
        that runs every round (so the study ends within one trial of the budget)."""
        by_trials = self.trials - self.finished - len(self.running)
        if by_trials > 0 or self.client_rounds <= 0:
            return by_trials
        per_trial = self.full_trial or self.most_per_trial()
        reserve = self.select.reruns() * per_trial  # the selection's first wave
        short = self.client_rounds - self.spent - reserve - len(self.running) * per_trial
        return -(-short // per_trial) if short > 0 else 0

    def trials_ended(self) -> bool:
        """Whether every trial of the budget has ended (none left to draw, none running)."""
        return self.left() <= 0 and not self.running

    def decided(self) -> bool:
        """Whether the study's choice is made (its selection ended; ``choice`` may be None)."""
        return self.selection is not None and self.selection.decided

    def choice(self) -> tuple[int, dict[str, Any]] | None:
        """The chosen trial's number and values; None until decided or when nothing is
        stable."""
        if self.selection is None or self.selection.chosen is None:
            return None
        return self.selection.chosen.trial, dict(self.selection.chosen.params)

    def most_per_trial(self) -> int:
        """The client-rounds of a trial that samples every client in every round."""
        return int(self.base["num-server-rounds"]) * int(self.base["num-clients"])

    def ended(self, run_dir: Path, complete: bool) -> None:
        """Count the client-rounds a trial's run at ``run_dir`` spent (``complete``: it ran
        every round)."""
        ran = run_spent(run_dir)["client-rounds"]
        self.spent += ran
        if complete:
            self.full_trial = max(self.full_trial, ran)

    def trial_cell(self, number: int, values: dict[str, Any]) -> Cell:
        """The cell of trial ``number`` with ``values``."""
        seed = int(self.base["seed"])
        config = {**self.base, **values}
        config["run-name"] = run_name(self.label, self.setup, f"{self.tag}-t{number:03d}", seed)
        link = None
        if self.journal is not None and self.pruner.name != "none":
            link = TrialLink(str(self.journal.resolve()), self.name, number, self.pruner)
        return Cell(self.label, self.setup + self.tag, seed, config, link)

    def rerun_cell(self, number: int, values: dict[str, Any], seed: int) -> Cell:
        """Trial ``number``'s values again at training ``seed``, on the trials' data and
        validation split (a selection re-run: no pruning)."""
        config = {**self.base, **values, "seed": seed, "data-seed": run_data_seed(self.base)}
        config["run-name"] = run_name(self.label, self.setup, f"{self.tag}-t{number:03d}", seed)
        return Cell(self.label, self.setup + self.tag, seed, config)

    def best(self) -> Any | None:
        """The best scored trial (``best_of``), None when none scored."""
        return best_of(self.optuna_study.get_trials(deepcopy=False))

    def metric(self) -> str:
        """The primary metric its trials report (their summary's, once one scored)."""
        return str(self.optuna_study.user_attrs.get("metric") or "accuracy")

    def scored_trials(self) -> list[ScoredTrial]:
        """Its complete trials as selection ranks them."""
        import optuna

        complete = (optuna.trial.TrialState.COMPLETE,)
        return [
            ScoredTrial(
                t.number,
                dict(t.params),
                float(t.value),
                self.trial_cell(t.number, dict(t.params)).run_dir,
            )
            for t in self.optuna_study.get_trials(deepcopy=False, states=complete)
        ]


def best_of(trials: list[Any]) -> Any | None:
    """The complete trial of the highest value among Optuna ``trials`` (the lowest number
    among equals), None when none is complete."""
    import optuna

    scored = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    return max(scored, key=lambda t: (t.value, -t.number), default=None)


def study_name(label: str, setup: str, tag: str) -> str:
    """The Optuna study name of ``label`` on ``setup`` (with the sweep's tag)."""
    return f"{label}@{setup}{tag}"


def study_parts(name: str) -> tuple[str, str]:
    """The method label and the setup with its tag of the study ``name`` (``study_name``'s
    inverse)."""
    label, _, setup = name.partition("@")
    return label, setup


def make_sampler(name: str, seed: int, trials: int) -> Any:
    """Optuna's sampler ``name`` seeded with ``seed``; TPE starts with a third of the budget
    (at least 2) drawn at random and lies constant for trials in flight."""
    import optuna

    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "tpe":
        return optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=max(2, trials // 3), constant_liar=True
        )
    raise ValueError(f"sampler '{name}' unknown; known: {', '.join(SAMPLERS)}")


def sampler_seed(tune_seed: int, label: str, drawn: int) -> int:
    """The seed of a study's sampler, derived (SHA-256: the same in every process and on every
    machine) from ``tune_seed``, the method ``label`` (each method's study draws its own
    points) and the ``drawn`` count (a resumed study does not replay the draws of the command
    that started it)."""
    digest = hashlib.sha256(f"{tune_seed}:{label}:{drawn}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def drawn_trials(trials: list[Any]) -> int:
    """How many of a study's Optuna trials its sampler drew (enqueued ones, as the setup's
    values of trial 0, carry ``fixed_params`` and do not count)."""
    return sum("fixed_params" not in t.system_attrs for t in trials)


def split_ablations(labels: list[str], at_parent: bool) -> tuple[list[str], dict[str, str]]:
    """The labels that get a study, and (with ``at_parent``) each ``method:variant`` label that
    runs at its method's chosen values instead, mapped to that method; a ``ValueError`` names a
    variant whose method the command does not name."""
    if not at_parent:
        return list(labels), {}
    studied = [label for label in labels if ":" not in label]
    ablations = {}
    for label in labels:
        if ":" in label:
            method = label.partition(":")[0]
            if method not in studied:
                raise ValueError(
                    f"--variants-at-parent: '{label}' runs at the values chosen for '{method}', "
                    f"and --methods does not name '{method}'"
                )
            ablations[label] = method
    return studied, ablations


def tuning_base(
    label: str,
    setup: str,
    seed: int,
    out: Path,
    overrides: dict[str, Any],
    val_fraction: float,
    tag: str = "",
    configs: Path = CONFIG_ROOT,
) -> dict[str, Any]:
    """The run config of ``label`` on ``setup`` at ``seed`` evaluated on validation data; a
    setup without a validation split holds out ``val_fraction`` of each client's training
    examples (``val_share``)."""
    config = cell_config(label, setup, seed, out / "tuning", overrides, tag, configs)
    if float(config.get("val-fraction", 0.0)) <= 0:
        config["val-fraction"] = val_share(val_fraction, config)
    config["evaluation-split"] = "val"
    return config


def val_share(of_training: float, config: dict[str, Any]) -> float:
    """The run config's ``val-fraction`` (a share of all of a client's examples, as
    ``test-fraction``) that holds out ``of_training`` of the client's training examples."""

    if not 0.0 < of_training < 1.0:
        raise ValueError(f"--val-fraction must lie in (0, 1), got {of_training}")
    test = float(config.get("test-fraction", ExperimentConfig().test_fraction))
    return round(of_training * (1.0 - test), 6)


def open_studies(
    labels: list[str],
    setups: list[str],
    args: argparse.Namespace,
    overrides: dict[str, Any],
) -> list[Study]:
    """Every study of the command, validated (configs, spaces, pruner settings and the configs
    of the variants run at a study's values) before any trial runs."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    studied, ablations = split_ablations(labels, args.variants_at_parent)
    journal = study_state(args).journal
    storage = journal_storage(journal)
    studies = []
    for setup in setups:
        bases = {}
        for label in studied:
            variants = [variant for variant, method in ablations.items() if method == label]
            base, *variant_bases = (
                tuning_base(
                    name,
                    setup,
                    args.tune_seed,
                    args.out,
                    overrides,
                    args.val_fraction,
                    args.tag,
                    args.configs,
                )
                for name in (label, *variants)
            )
            check_configs([base, *variant_bases])
            bases[label] = (base, variants)
        pruner = setup_pruner(args, [base for base, _ in bases.values()])
        check_table_pruner(storage, f"@{setup}{args.tag}", pruner)
        for label, (base, variants) in bases.items():
            space = resolve_space(method_space(base), base)
            name = study_name(label, setup, args.tag)
            study = optuna.create_study(
                study_name=name,
                storage=storage,
                direction="maximize",
                pruner=pruner.make(),
                load_if_exists=True,
            )
            trials = study.get_trials(deepcopy=False)
            keep_pruner(study, name, pruner, bool(trials))
            seed = sampler_seed(args.tune_seed, label, drawn_trials(trials))
            study.sampler = make_sampler(args.sampler, seed, args.trials)
            if args.setup_first and not trials:
                study.enqueue_trial(setup_values(space, base))  # a new study: the untuned run
            ended = [trial for trial in trials if trial.state.name in ENDED_STATES]
            opened = Study(
                label,
                setup,
                args.tag,
                base,
                space,
                study,
                args.trials,
                len(ended),
                variants,
                client_rounds=args.client_rounds,
                pruner=pruner,
                journal=journal,
                select=selection_settings(args),
            )
            for trial in ended:  # earlier commands' spending (their runs are restored)
                run_dir = opened.trial_cell(trial.number, dict(trial.params)).run_dir
                opened.ended(run_dir, trial.state.name == "COMPLETE")
            studies.append(opened)
    return studies


def selection_settings(args: argparse.Namespace) -> SelectionSettings:
    """How the command's studies choose (``--select-*``, ``--diverge-drop``); the re-run seeds
    default to the ``DEFAULT_EXTRA_SEEDS`` seeds after the tuning seed."""
    seeds = args.select_seeds
    if seeds is None:
        seeds = [args.tune_seed + i for i in range(1, DEFAULT_EXTRA_SEEDS + 1)]
    settings = SelectionSettings(
        args.select_top, tuple(seeds), args.select_last_rounds, args.diverge_drop
    )
    settings.check(args.tune_seed)
    return settings


def final_data_seeds(args: argparse.Namespace) -> list[int]:
    """The data seed of each final seed: ``--data-seeds`` (one per ``--seeds``), by default
    the seed itself (a data draw, and foundation build, per seed)."""
    if args.data_seeds is None:
        return list(args.seeds)
    if len(args.data_seeds) != len(args.seeds):
        raise ValueError(
            f"--data-seeds gives {len(args.data_seeds)} seeds for {len(args.seeds)} --seeds: "
            "one data seed per final seed"
        )
    if any(seed < 0 for seed in args.data_seeds):
        raise ValueError(f"--data-seeds must be >= 0, got {args.data_seeds}")
    return list(args.data_seeds)


def transfer_settings(setup: str, name: str, configs: Path = CONFIG_ROOT) -> dict[str, Any]:
    """What ``configs/transfer/<setup>/<name>.toml`` changes of ``setup`` for the transfer
    setup ``name``; ``FileNotFoundError`` names a missing file, ``ValueError`` an empty one."""

    path = configs / TRANSFER_ROOT / setup / f"{name}.toml"
    if not path.is_file():
        raise FileNotFoundError(f"--transfer {name}: {path} does not exist (setup {setup})")
    keys = tomllib.loads(path.read_text())
    if not keys:
        raise ValueError(f"--transfer {name}: {path} changes nothing of setup {setup}")
    return keys


def transfer_changes(study: Study, name: str, configs: Path = CONFIG_ROOT) -> dict[str, Any]:
    """What the transfer setup ``name`` changes of ``study``'s setup (``transfer_settings``);
    a ``ValueError`` when it sets a key the study chooses: a transfer setup changes the data
    or the federation, never a chosen value."""
    changed = transfer_settings(study.setup, name, configs)
    tuned = sorted(set(changed) & {*study.space, "val-fraction", "data-seed"})
    if tuned:
        raise ValueError(
            f"--transfer {name}: configs/{TRANSFER_ROOT}/{study.setup}/{name}.toml sets "
            f"{', '.join(tuned)}, which the study of {study.label} chooses; a transfer setup "
            "changes the data or the federation, never a chosen value"
        )
    return changed


def transfer_setup(setup: str, name: str) -> str:
    """The setup name of a transfer run: ``<setup><TRANSFER_MARK><name>`` (the report's
    transfer section reads the base setup back from it)."""
    return f"{setup}{TRANSFER_MARK}{name}"


def study_state(args: argparse.Namespace) -> StudyState:
    """Where the command keeps its studies' state: ``--state``, by default ``--out``."""
    return StudyState(args.out, args.state or args.out)


def setup_pruner(args: argparse.Namespace, bases: list[dict[str, Any]]) -> PrunerSettings:
    """The pruner of one setup's studies (one table): ``--pruner`` with its first rung at
    ``--prune-min-rounds``, by default the largest ``eval-every`` of the studies (each has
    reported by then); a ``ValueError`` names a bad value."""

    default = ExperimentConfig().eval_every
    min_rounds = args.prune_min_rounds
    if min_rounds is None:
        min_rounds = max(int(base.get("eval-every", default)) for base in bases)
    return PrunerSettings(args.pruner, min_rounds, args.prune_reduction)


def check_table_pruner(storage: Any, suffix: str, pruner: PrunerSettings) -> None:
    """A ``ValueError`` when a study of the table (the studies named ``*<suffix>``: one setup
    and tag) ran its trials with other pruner settings: a study added to a table later is
    pruned as its other methods were."""
    for other in storage.get_all_studies():
        if not other.study_name.endswith(suffix):
            continue
        study_id = storage.get_study_id_from_name(other.study_name)
        if not storage.get_all_trials(study_id, deepcopy=False):
            continue
        recorded = other.user_attrs.get("pruner", {"name": "none"})
        if recorded != pruner.as_dict():
            raise ValueError(
                f"study {other.study_name} of this table ran its trials with pruner {recorded}, "
                f"and this command asks for {pruner.as_dict()}: every method of a table is "
                "pruned alike; give the options it ran with (--pruner, --prune-min-rounds, "
                "--prune-reduction), or tune into another --state"
            )


def keep_pruner(study: Any, name: str, pruner: PrunerSettings, has_trials: bool) -> None:
    """Record ``pruner`` in the study; a ``ValueError`` when its trials ran with another (a
    study older than pruning ran without one): every trial of a study is pruned alike."""
    recorded = study.user_attrs.get("pruner", {"name": "none"})
    if has_trials and recorded != pruner.as_dict():
        raise ValueError(
            f"study {name} ran its trials with pruner {recorded}, and this command asks for "
            f"{pruner.as_dict()}: give the options it ran with (--pruner, --prune-min-rounds, "
            "--prune-reduction), or tune into another --state"
        )
    study.set_user_attr("pruner", pruner.as_dict())


@dataclass
class FinalRuns:
    """The final runs of the studies whose trials have all ended: queued once a study's last
    trial is scored, run in the pool's free slots, recorded in ``<out>/sweep.json``."""

    seeds: list[int]
    out: Path
    overrides: dict[str, Any]
    configs: Path
    log: SweepLog
    on_study_done: Callable[[], None] = lambda: None  # e.g. rewrite tuning.json
    data_seeds: list[int] | None = None  # one per seed (None: the seed's own)
    transfers: list[str] = field(default_factory=list)  # configs/transfer/<setup>/<name>.toml
    queue: deque[Cell] = field(default_factory=deque)
    records: dict[Path, dict[str, Any]] = field(default_factory=dict)  # run dir -> record
    errors: list[str] = field(default_factory=list)
    _released: set[str] = field(default_factory=set)
    _dirs: set[Path] = field(default_factory=set)

    def release(self, studies: list[Study]) -> None:
        """Queue the final runs of every study whose choice has just been made."""
        for study in studies:
            if study.name in self._released or not study.decided():
                continue
            self._released.add(study.name)
            self.on_study_done()
            try:
                cells = final_cells(
                    [study],
                    self.seeds,
                    self.out,
                    self.overrides,
                    self.configs,
                    self.data_seeds,
                    self.transfers,
                )
            except ValueError as err:
                self.errors.append(str(err))
                continue
            self.queue.extend(cells)
            self._dirs.update(cell.run_dir for cell in cells)

    def owns(self, cell: Cell) -> bool:
        """Whether ``cell`` is one of the final runs."""
        return cell.run_dir in self._dirs

    def record(self, cell: Cell, record: dict[str, Any]) -> None:
        """Keep a finished final run's record and write it to ``sweep.json``."""
        self.records[cell.run_dir] = record
        self.log.add(cell, record)


def trial_kind(study: Study) -> str:
    """The kind of a study's trials in the time left: apart from its final runs'
    (``Cell.kind``), which run every round where many trials are pruned."""
    return cell_kind(study.label, study.setup + study.tag) + " trials"


def cell_kinds(
    studies: list[Study], seeds: list[int], transfers: Sequence[str] = ()
) -> Counter[str]:
    """How many cells of each kind the studies have left: their trials to draw
    (``trial_kind``), their selection's first wave of re-runs (a final run's kind: they run
    every round) and their final runs at ``seeds`` (``Cell.kind``) on their setup and every
    ``transfers`` setup, their ablations' included."""
    kinds: Counter[str] = Counter()
    for study in studies:
        setup = study.setup + study.tag
        kinds[trial_kind(study)] += study.left()
        if not study.decided():
            kinds[cell_kind(study.label, setup)] += study.select.reruns()
        for label in (study.label, *study.ablations):
            for place in (setup, *(transfer_setup(setup, name) for name in transfers)):
                kinds[cell_kind(label, place)] += len(seeds)
    return kinds


def cells_left(studies: list[Study], seeds: list[int], transfers: Sequence[str] = ()) -> int:
    """How many cells the studies have left (``cell_kinds``'s total)."""
    return sum(cell_kinds(studies, seeds, transfers).values())


def earlier_seconds(studies: list[Study]) -> dict[str, list[float]]:
    """The seconds of rounds of the ended trials of ``studies`` (earlier commands'), by kind:
    every ended trial for its study's trials (``trial_kind``), the complete ones (every round
    run, as a final run does) for its final runs (``Cell.kind``). The time left takes them
    for a kind until a cell of it runs."""
    import optuna

    complete, pruned = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED
    seconds: dict[str, list[float]] = {}
    for study in studies:
        final_kind = cell_kind(study.label, study.setup + study.tag)
        for trial in study.optuna_study.get_trials(deepcopy=False, states=(complete, pruned)):
            ran = run_spent(study.trial_cell(trial.number, dict(trial.params)).run_dir)
            if ran["seconds"] <= 0:
                continue
            seconds.setdefault(trial_kind(study), []).append(ran["seconds"])
            if trial.state == complete:
                seconds.setdefault(final_kind, []).append(ran["seconds"])
    return seconds


def run_trials(
    studies: list[Study],
    pool: CellPool,
    finals: FinalRuns | None = None,
    time_left: TimeLeft | None = None,
    state: StudyState | None = None,
    foundations: SetupFoundations | None = None,
) -> None:
    """Draw and run every study's missing trials in ``pool``, as many at once as it holds;
    once a study's last trial has ended, its selection's re-runs (``fedfm_flower.study.selection``),
    and with ``finals`` its final runs as soon as its choice is made, in the slots no trial is
    left to take. A trial whose run the pruner stopped is told pruned. Each finished run's
    small files go to ``state``, after ``foundations`` has checked that it ran on its setup's
    model (``FoundationMismatch`` if not: nothing of it is kept or told); each trial's line
    ends with ``time_left``'s estimate."""
    import optuna

    time_left = time_left or TimeLeft(sum(s.left() for s in studies), cell_kinds(studies, []))

    def start(study: Study, number: int, values: dict[str, Any]) -> None:
        cell = study.trial_cell(number, values)
        study.running[cell.run_dir] = number
        pool.submit(cell)

    def rerun_ended(study: Study, cell: Cell, record: dict[str, Any] | None) -> None:
        number, seed = study.selecting.pop(cell.run_dir)
        selection = study.selection
        assert selection is not None  # a re-run is asked by an open selection only
        selection.take(number, seed, cell.run_dir)
        if record is not None:
            said = time_left.ended(cell.kind, record.get("seconds"), record.get("state-before"))
            outcome = selection.candidates_outcome(number, seed)
            print(f"[{study.name} trial {number} at seed {seed}] {outcome}; {said}", flush=True)
        if selection.decided:
            print(f"[{study.name}] {selection.verdict()}", flush=True)

    def advance_selection(study: Study) -> None:
        """Open a study's selection once its trials have ended; queue the re-runs its wave
        wants (a re-run finished before, e.g. restored from the state, is read, not run)."""
        if not study.trials_ended():
            return
        if study.selection is None:
            study.selection = Selection(study.select, int(study.base["seed"]), study.metric())
            study.selection.start(study.scored_trials())
            if study.selection.decided:
                print(f"[{study.name}] {study.selection.verdict()}", flush=True)
        asked = True
        while asked and not study.selection.decided:
            asked = False
            for number, values, seed in study.selection.wanted():
                cell = study.rerun_cell(number, values, seed)
                if cell.run_dir in study.selecting:
                    continue
                study.selecting[cell.run_dir] = (number, seed)
                if cell_state(cell) == "done":
                    rerun_ended(study, cell, None)
                    asked = True  # the wave may have changed: look again
                    break
                study.reruns.append(cell)

    for study in studies:  # trials an interrupted command left running: rerun them first
        for trial in study.optuna_study.get_trials(
            deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)
        ):
            if study.left() > 0:
                start(study, trial.number, dict(trial.params))
            else:
                study.optuna_study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
                study.finished += 1
    capacity = pool.capacity()
    while True:
        for study in studies:  # round-robin over studies while the pool has room
            while study.left() > 0 and pool.pending() < capacity:
                trial = study.optuna_study.ask()
                start(study, trial.number, suggest(trial, study.space))
            advance_selection(study)
            while study.reruns and pool.pending() < capacity:
                pool.submit(study.reruns.popleft())
        if finals is not None:
            finals.release(studies)
            while finals.queue and pool.pending() < capacity:
                pool.submit(finals.queue.popleft())
        if not pool.pending():
            return
        cell, record = pool.next_done()
        if foundations is not None:
            foundations.add(cell.run_dir)
        if state is not None:
            state.keep_run(cell.run_dir, ended=True)
        if finals is not None and finals.owns(cell):
            finals.record(cell, record)
            continue
        study = next(s for s in studies if cell.run_dir in s.running or cell.run_dir in s.selecting)
        if cell.run_dir in study.selecting:
            rerun_ended(study, cell, record)
            continue
        number = study.running.pop(cell.run_dir)
        value = record.get("final", math.nan)
        complete = False
        if record["state"] == "done" and "stopped-at-round" in record:
            study.optuna_study.tell(number, state=optuna.trial.TrialState.PRUNED)
            outcome = f"pruned at round {record['stopped-at-round']}: val {value:.4f}"
        elif record["state"] == "done" and math.isfinite(value):
            study.optuna_study.set_user_attr("metric", record["metric"])
            study.optuna_study.tell(number, value)
            outcome = f"val {record['metric']} {value:.4f}"
            complete = True
        else:
            study.optuna_study.tell(number, state=optuna.trial.TrialState.FAIL)
            outcome = f"failed: {record.get('error', f'final value {value}')}"
        study.finished += 1
        study.ended(cell.run_dir, complete)
        before = record.get("state-before", "new")
        said = time_left.ended(trial_kind(study), record.get("seconds"), before)
        budget = f"{study.finished}/{study.trials}"
        if study.client_rounds > 0:
            budget += f", {study.spent}/{study.client_rounds} client-rounds"
        print(f"[{study.name} trial {number}, {budget}] {outcome}; {said}", flush=True)


def study_record(study: Study) -> dict[str, Any]:
    """What ``tuning.json`` says of one study."""
    trials = []
    for trial in study.optuna_study.get_trials(deepcopy=False):
        run = study.trial_cell(trial.number, dict(trial.params)).run_dir
        pruned = trial.state.name == "PRUNED"
        record = {
            "number": trial.number,
            "values": dict(trial.params),
            "score": None if pruned else trial.value,  # a pruned trial's value is not final
            "state": trial.state.name.lower(),
            "run": str(run),
            **run_spent(run),
        }
        if pruned and trial.last_step is not None:
            record["last-round"] = trial.last_step
            record["last-value"] = trial.intermediate_values[trial.last_step]
        trials.append(record)
    selection = study.selection
    reruns = [] if selection is None else rerun_records(selection)
    chosen = None if selection is None else selection.chosen
    return {
        **_record_head(study, study.label),
        "space": {key: describe(rng) for key, rng in study.space.items()},
        "pruner": study.pruner.as_dict(),
        "budget": study.trials,
        "client-rounds-budget": study.client_rounds,
        "spent": spent(trials, reruns),
        "trials": trials,
        "tried": tried_ranges(trials),
        "selection": None if selection is None else selection.record(),
        "chosen": None if chosen is None else {"trial": chosen.trial, "values": chosen.params},
        "best-score": None if chosen is None else chosen.single,
        "selection-score": None if chosen is None or not reruns else chosen.score,
        "ablations": list(study.ablations),
    }


def rerun_records(selection: Selection) -> list[dict[str, Any]]:
    """What the ended re-runs of ``selection`` spent (``run_spent``), one record each."""
    return [
        {"run": outcome.run, **run_spent(Path(outcome.run))}
        for candidate in selection.candidates
        for seed, outcome in candidate.outcomes.items()
        if seed != selection.tune_seed
    ]


def run_spent(run_dir: Path) -> dict[str, Any]:
    """What a run has spent, from its ``metrics.jsonl``: the rounds it ran, its client-rounds
    (the clients sampled, summed over those rounds) and the seconds of those rounds."""

    rounds = RunDirectory(run_dir).rounds()
    return {
        "rounds": len(rounds),
        "client-rounds": sum(int(r.get("clients-sampled", 0)) for r in rounds),
        "seconds": round(sum(float(r.get("round-seconds", 0.0)) for r in rounds), 3),
    }


def spent(trials: list[dict[str, Any]], reruns: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """A study's spending, from its trials' and its selection re-runs' records: the trials
    that ended (of them pruned), the re-runs, and the rounds, client-rounds and seconds all of
    them ran (the re-runs' client-rounds also apart)."""
    return {
        "trials": sum(t["state"] in ("complete", "pruned", "fail") for t in trials),
        "pruned": sum(t["state"] == "pruned" for t in trials),
        "reruns": len(reruns),
        "rerun-client-rounds": sum(r["client-rounds"] for r in reruns),
        **summed([*trials, *reruns], ("rounds", "client-rounds", "seconds")),
    }


def summed(records: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """The sum over ``records`` of each of ``keys``."""
    return {key: round(sum(record[key] for record in records), 3) for key in keys}


def _record_head(study: Study, label: str) -> dict[str, Any]:
    """The keys every record of ``tuning.json`` starts with, for ``label`` on ``study``'s setup."""
    return {
        "study": study_name(label, study.setup, study.tag),
        "label": label,
        "setup": study.setup,
        "metric": study.optuna_study.user_attrs.get("metric", ""),
        "val-fraction": study.base["val-fraction"],
    }


def ablation_record(study: Study, label: str) -> dict[str, Any]:
    """What ``tuning.json`` says of a ``method:variant`` label run at ``study``'s values: no
    trials of its own, the values of its method's study."""
    return {
        **_record_head(study, label),
        "space": {},
        "budget": 0,
        "trials": [],
        "values-of": study.name,
        "chosen": None,
        "best-score": None,
    }


def final_cells(
    studies: list[Study],
    seeds: list[int],
    out: Path,
    overrides: dict[str, Any],
    configs: Path,
    data_seeds: list[int] | None = None,
    transfers: list[str] | None = None,
) -> list[Cell]:
    """The test runs of every study's chosen values at ``seeds`` (seed i on data seed
    ``data_seeds[i]``, by default the seed itself), then those of its ablations
    (``method:variant`` labels) at the same values, where their variant file sets no other,
    each on the study's setup and then unchanged on every ``transfers`` setup (studies
    without a choice have none); a ``ValueError`` names a transfer file that sets a tuned key."""
    cells = []
    data_seeds = list(seeds) if data_seeds is None else data_seeds
    for study in studies:
        choice = study.choice()
        if choice is None:
            continue
        _, params = choice
        places = [("", {})] + [
            (TRANSFER_MARK + name, transfer_changes(study, name, configs))
            for name in transfers or []
        ]
        for label in (study.label, *study.ablations):
            own = variant_settings(label, configs)  # an ablation keeps what its file sets
            for suffix, changed in places:
                for seed, data_seed in zip(seeds, data_seeds, strict=True):
                    # The trials' validation share (so as many training examples), the seed's
                    # own data draw and foundation build: intervals carry the partition's
                    # variance, not only training's.
                    chosen = {
                        "val-fraction": study.base["val-fraction"],
                        "data-seed": data_seed,
                        **params,
                    }
                    values = {k: v for k, v in chosen.items() if k not in own}
                    config = cell_config(
                        label,
                        study.setup,
                        seed,
                        out,
                        {**overrides, **values, **changed},
                        study.tag + suffix,
                        configs,
                    )
                    cells.append(Cell(label, study.setup + study.tag + suffix, seed, config))
                    _refuse_stale_run(cells[-1], {**values, **changed})
    check_configs([cell.config for cell in cells])
    return cells


def _refuse_stale_run(cell: Cell, values: dict[str, Any]) -> None:
    """A ``ValueError`` when the cell's run directory holds a run made with other values (the
    choice changed since, e.g. with a larger ``--trials``): resuming or reusing it would report
    values that were not chosen."""
    try:
        made = json.loads((cell.run_dir / "config.json").read_text())["run-config"]
    except (OSError, ValueError, KeyError):
        return
    made = {**made, "data-seed": run_data_seed(made)}
    differ = {k: (made.get(k), v) for k, v in values.items() if made.get(k) != v}
    if differ:
        said = ", ".join(f"{k} = {old!r}, now {new!r}" for k, (old, new) in differ.items())
        raise ValueError(
            f"final run {cell.run_dir} was made with other values ({said}); move it (and "
            f"{cell.config['client-state-dir']}/{cell.run_dir.name}, if there) away, or tune "
            "into a new --out"
        )


def _study_key(record: dict[str, Any]) -> str:
    return record.get("study") or study_name(record["label"], record["setup"], "")


def _earlier_document(out: Path) -> dict[str, Any]:
    """``<out>/tuning.json`` as an earlier command wrote it; empty if missing, ``StateError``
    if it does not parse (``main`` refuses that before any trial)."""
    return read_tuning(out / "tuning.json")


def _earlier_studies(out: Path) -> dict[str, dict[str, Any]]:
    """The study records ``<out>/tuning.json`` holds (by study name); none if it has none."""
    try:
        return {_study_key(record): record for record in _earlier_document(out)["studies"]}
    except (KeyError, TypeError):
        return {}


def earlier_wall_seconds(out: Path) -> float:
    """The wall seconds of the commands that tuned into ``out`` so far (``tuning.json``)."""
    return float(_earlier_document(out).get("wall-seconds", 0.0))


def write_tuning(
    studies: list[Study], out: Path, args: argparse.Namespace, wall_seconds: float | None = None
) -> None:
    """``<out>/tuning.json``: the budget, the sampler, every study's record (with the records
    of studies that earlier commands into ``out`` ran and this one does not name), what they
    spent, and the commands' wall seconds (``wall_seconds``, or the earlier value)."""
    if wall_seconds is None:
        wall_seconds = earlier_wall_seconds(out)
    records = _earlier_studies(out)
    for study in studies:
        record = study_record(study)
        earlier = records.get(study.name, {}).get("ablations", [])
        record["ablations"] = sorted({*earlier, *study.ablations})
        records[study.name] = record
        for label in study.ablations:
            ablation = ablation_record(study, label)
            records[ablation["study"]] = ablation
    document = {
        "sampler": args.sampler,
        "trials-per-study": args.trials,
        "client-rounds-per-study": args.client_rounds,
        "setup-first": args.setup_first,
        "tuning-seed": args.tune_seed,
        "final-seeds": args.seeds,
        "final-data-seeds": final_data_seeds(args),
        "transfer": {
            study.setup + study.tag: [
                transfer_setup(study.setup + study.tag, name) for name in args.transfer
            ]
            for study in studies
        },
        "selection": selection_settings(args).describe(),
        "selection-settings": selection_settings(args).as_dict(),
        "spent": summed(
            [r["spent"] for r in records.values() if "spent" in r],
            ("trials", "pruned", "rounds", "client-rounds", "seconds"),
        ),
        "wall-seconds": round(wall_seconds, 1),
        "studies": list(records.values()),
    }
    atomic_write_text(out / "tuning.json", json.dumps(document, indent=2))


def main(argv: list[str] | None = None) -> int:
    """Tune, then run the chosen values; exit 0 (all done), 1 (a study or run failed), 2 (bad
    arguments: nothing run), 130 (interrupted with Ctrl-C), SIGTERM's 143 (1 when it lands
    inside Ray's wait)."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.tune", description=__doc__.split("\n")[0]
    )
    add_grid_arguments(parser)
    parser.add_argument("--trials", type=int, required=True, help="budget per method x setup")
    parser.add_argument(
        "--client-rounds",
        type=int,
        default=0,
        help="a budget in client-rounds per method x setup besides --trials: a study draws "
        "trials past --trials until its ended trials ran this many client-rounds (pruned and "
        "failed ones' rounds included), so every method of a table spends the same, within "
        "one trial; default 0: --trials alone",
    )
    parser.add_argument("--sampler", choices=SAMPLERS, default="tpe")
    parser.add_argument(
        "--no-setup-first",
        dest="setup_first",
        action="store_false",
        help="draw every trial; default: a study's first trial is the setup's own values",
    )
    parser.add_argument(
        "--variants-at-parent",
        action="store_true",
        help="a method:variant label gets no study: its final runs use the values chosen for "
        "its method (which --methods must name), so the ablation differs in its part alone",
    )
    parser.add_argument("--tune-seed", type=int, default=0, help="seed of the tuning runs")
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=list(DEFAULT_SEEDS),
        help="seeds of the final runs on the test split; default 0-4",
    )
    parser.add_argument(
        "--data-seeds",
        nargs="+",
        type=int,
        default=None,
        help="the data seed of each final seed (one per --seeds); default: the seed itself, "
        "a new partition and foundation build per seed (intervals carry the data's variance "
        "too); the tuning seed's, e.g. 0 0 0, for the trials' data at every seed",
    )
    parser.add_argument(
        "--transfer",
        nargs="+",
        default=[],
        metavar="NAME",
        help="also run each chosen value unchanged on configs/transfer/<setup>/NAME.toml (a "
        "setup no trial saw), at every final seed; the report re-tests each verdict there",
    )
    choosing = parser.add_argument_group("choosing among the trials (fedfm_flower.study.selection)")
    choosing.add_argument(
        "--select-top",
        type=int,
        default=DEFAULT_TOP,
        help="candidates per wave: the best trials by single-seed score, re-run at "
        "--select-seeds; 0: the best single-seed trial that did not diverge, no re-runs",
    )
    choosing.add_argument(
        "--select-seeds",
        nargs="+",
        type=int,
        default=None,
        help="training seeds of the re-runs (on the trials' data and validation split); "
        f"default: the {DEFAULT_EXTRA_SEEDS} seeds after --tune-seed",
    )
    choosing.add_argument(
        "--select-last-rounds",
        type=int,
        default=DEFAULT_LAST_ROUNDS,
        help="a run's score: the mean of its last this-many evaluated rounds",
    )
    choosing.add_argument(
        "--diverge-drop",
        type=float,
        default=DEFAULT_DROP,
        help="a run diverged when an evaluated round after its best falls more than this "
        "share of the best below it (or a value is not finite); it cannot be chosen",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help="share of each client's training examples held out for validation, for setups "
        "that hold none (the final runs hold out the same examples)",
    )
    parser.add_argument("--out", type=Path, required=True, help="tuning directory")
    pruning = parser.add_argument_group("pruning of bad trials (the same for every method)")
    pruning.add_argument("--pruner", choices=PRUNERS, default=DEFAULT_PRUNER)
    pruning.add_argument(
        "--prune-min-rounds",
        type=int,
        default=None,
        help="the first rung, in rounds; default: the largest eval-every of a setup's studies",
    )
    pruning.add_argument(
        "--prune-reduction",
        type=int,
        default=DEFAULT_REDUCTION,
        help="1 / this share of the trials at a rung goes on (rungs at min-rounds x this^k)",
    )
    parser.add_argument(
        "--state",
        type=Path,
        default=None,
        help="where the journal, tuning.json and finished runs' small files are kept (e.g. "
        "bench/results/<study>, committed as the study goes); default: --out",
    )
    args = parser.parse_args(argv)

    configure_logging()
    started = time.monotonic()
    state = study_state(args)
    try:
        require_package("--sampler", args.sampler, "optuna", " (pip install 'fedfm-flower[tune]')")
        if args.trials < 1:
            raise ValueError(f"--trials must be >= 1, got {args.trials}")
        if args.client_rounds < 0:
            raise ValueError(f"--client-rounds must be >= 0, got {args.client_rounds}")
        selection_settings(args)
        data_seeds = final_data_seeds(args)
        overrides = parse_overrides(args.set)
        state.check()
        state.check_foundations()
        state.restore()
        foundations = SetupFoundations.of_finished_runs(
            [runs_of(args.out / "tuning"), runs_of(args.out)]
        )
        wall_before = earlier_wall_seconds(args.out)
        studies = open_studies(args.methods, args.setups, args, overrides)
        for study in studies:  # every transfer file there, setting no tuned key, valid
            check_configs(
                [
                    cell_config(
                        study.label,
                        study.setup,
                        args.tune_seed,
                        args.out,
                        {**overrides, **transfer_changes(study, name, args.configs)},
                        study.tag + TRANSFER_MARK + name,
                        args.configs,
                    )
                    for name in args.transfer
                ]
            )
        for cache in sorted({cache_dir_of(study.base) for study in studies}):
            state.install_foundations(cache)
        pool = pool_from_arguments(args)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    def save_tuning() -> None:
        write_tuning(studies, args.out, args, wall_before + time.monotonic() - started)
        state.keep(args.out / "tuning.json")

    places = 1 + len(args.transfer)  # the study's setup and its transfer setups
    final_total = sum(1 + len(study.ablations) for study in studies) * len(args.seeds) * places
    time_left = TimeLeft(
        cells_left(studies, args.seeds, args.transfer),
        cell_kinds(studies, args.seeds, args.transfer),
        earlier=earlier_seconds(studies),
    )
    finals = FinalRuns(
        args.seeds,
        args.out,
        overrides,
        args.configs,
        SweepLog(args.out, final_total, time_left),
        on_study_done=save_tuning,
        data_seeds=data_seeds,
        transfers=list(args.transfer),
    )

    def work() -> None:
        try:
            run_trials(studies, pool, finals, time_left, state, foundations)
        finally:  # also when stopped (Ctrl-C, SIGTERM, a mismatch): the wall time is kept
            save_tuning()

    stopped = run_grid(pool, work)
    if stopped is not None:
        return stopped
    unscored = [s for s in studies if s.choice() is None]
    records = list(finals.records.values())
    for err in finals.errors:
        print(f"error: {err}", file=sys.stderr)
    failed = [r for r in records if r["state"] == "failed"]
    for study in unscored:
        why = "no scored trial" if study.best() is None else "no stable trial (every one diverged)"
        print(f"error: study {study.name} has {why} (see tuning.json)", file=sys.stderr)
    if failed:
        print(f"error: {len(failed)} final runs failed (see sweep.json)", file=sys.stderr)
    if failed or unscored or finals.errors:
        return 1
    print(
        f"tuning done: {len(studies)} studies, {len(records)} final runs in {args.out}; report: "
        f"python -m fedfm_flower.report {args.out} --out <dir>"
    )
    return 0
