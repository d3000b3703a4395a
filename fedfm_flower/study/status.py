"""Where a tuning directory stands, read without running or writing anything: per study its
trials that ended (of them pruned and failed), those left running and those queued (enqueued,
never asked: a study's trial 0 at the setup's values before its first run), against its
budget, the client-rounds its trials ran so far (from their runs' ``metrics.jsonl``, running
ones included; a selection's re-runs, ``fedfm_flower.study.selection``, too) against its
``--client-rounds``, the best trial so far by its single-seed score, the trial the study's
selection chose once it has (``tuning.json``), and the seeds of its final runs that finished
or started, on its setup and on each transfer setup.

    python -m fedfm_flower.study_status runs/tuned16-tap          # a tune --out directory
    python -m fedfm_flower.study_status bench/results/tuned16-tap --json   # or its --state

The Optuna journal is read from a copy of its complete records, so a study running meanwhile
is neither locked nor disturbed (a record being written is left out). The budget is the one
``tuning.json`` records (per study, else per command; unknown before the command first wrote
it). Final runs are matched to a study by their run name (``sweep.run_name``); those of no
study (a method's variants at its values) are listed by name. Last, whether the finished runs
of each setup and data seed share one foundation model (else ``tune`` refuses the directory:
``grid_foundations``). Light: no torch.

Imports inside functions keep ``optuna`` out of this module's start-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedfm_flower.study.cells import TRANSFER_MARK, runs_of
from fedfm_flower.study.grid_foundations import FoundationMismatch, SetupFoundations
from fedfm_flower.study.state import (
    JOURNAL,
    TUNING,
    StateError,
    client_round_budgets,
    parsed_lines,
    read_tuning,
)
from fedfm_flower.study.sweep import seed_of_run
from fedfm_flower.study.tune import best_of, run_spent, study_parts


@dataclass
class StudyStatus:
    """One study of a tuning directory, as far as it has got."""

    study: str  # label@setup (with the tag)
    budget: int | None  # trials to run; None: no tuning.json yet
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    running: int = 0  # asked, not told: running now, or left by a command that died
    queued: int = 0  # enqueued, never asked (Optuna's WAITING)
    client_rounds: int = 0  # run by its trials' runs found under tuning/runs (running ones too)
    client_rounds_budget: int = 0  # tune --client-rounds (0: none)
    best_trial: int | None = None
    best_score: float | None = None
    best_values: dict[str, Any] = field(default_factory=dict)
    finals_done: list[int] = field(default_factory=list)  # seeds whose final run finished
    finals_started: list[int] = field(default_factory=list)  # seeds with a run not finished
    chosen_trial: int | None = None  # the selection's choice (tuning.json), once made
    chosen_score: float | None = None  # its score over seeds (None: chosen on one seed)
    transfers_done: dict[str, list[int]] = field(default_factory=dict)  # setup -> seeds

    @property
    def ended(self) -> int:
        """The trials that ended: complete, pruned or failed."""
        return self.complete + self.pruned + self.failed


def journal_trials(journal: Path) -> dict[str, list[Any]]:
    """Every study's frozen trials in the Optuna journal ``journal``, read from a copy of its
    complete records; ``StateError`` when there is no journal or a record does not parse."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    try:
        data = journal.read_bytes()
    except OSError as err:
        raise StateError(
            f"no Optuna journal at {journal} ({err.strerror}); a study run with --state keeps "
            "its journal there: pass that directory"
        ) from None
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "journal.log"
        copy.write_bytes(data[: data.rfind(b"\n") + 1])
        parsed_lines(copy, whole=False, shown=journal)
        storage = JournalStorage(JournalFileBackend(str(copy)))
        try:
            names = optuna.get_all_study_names(storage)
            return {
                name: optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
                for name in names
            }
        except (ValueError, KeyError) as err:  # a record Optuna cannot replay
            raise StateError(f"{journal}: not an Optuna journal Optuna can read ({err})") from None


def directory_status(root: Path) -> tuple[list[StudyStatus], list[str]]:
    """The studies of the tuning (or state) directory ``root`` and the final runs of no study
    (by name); ``StateError`` for a missing or damaged journal or ``tuning.json``."""
    import optuna

    states = optuna.trial.TrialState
    tuning = read_tuning(root / TUNING)
    budgets = {s.get("study"): s.get("budget") for s in tuning.get("studies", [])}
    records = {s.get("study"): s for s in tuning.get("studies", [])}
    transfers = tuning.get("transfer", {})
    round_budgets = client_round_budgets(tuning)
    finals = _final_runs(root)
    trial_folder = runs_of(root / "tuning")
    trial_runs = sorted(trial_folder.iterdir()) if trial_folder.is_dir() else []
    statuses = []
    for name, trials in journal_trials(root / JOURNAL).items():
        budget = budgets.get(name, tuning.get("trials-per-study"))
        status = StudyStatus(name, None if budget is None else int(budget))
        status.client_rounds_budget = round_budgets.get(
            name, int(tuning.get("client-rounds-per-study") or 0)
        )
        label, setup = study_parts(name)
        status.client_rounds = sum(
            _trial_client_rounds(trial_runs, label, setup, trial.number) for trial in trials
        )
        for trial in trials:
            if trial.state == states.COMPLETE:
                status.complete += 1
            elif trial.state == states.PRUNED:
                status.pruned += 1
            elif trial.state == states.FAIL:
                status.failed += 1
            elif trial.state == states.RUNNING:
                status.running += 1
            elif trial.state == states.WAITING:
                status.queued += 1
        best = best_of(trials)  # the trial tune chooses
        if best is not None:
            status.best_trial, status.best_score = best.number, float(best.value)
            status.best_values = dict(best.params)
        chosen = (records.get(name) or {}).get("chosen")
        if chosen is not None:
            status.chosen_trial = int(chosen["trial"])
            status.chosen_score = records[name].get("selection-score")
        for run in list(finals):
            seed = seed_of_run(run, label, setup, "")
            if seed is not None:
                seeds = status.finals_done if finals.pop(run) else status.finals_started
                seeds.append(seed)
            for place in transfers.get(setup, []):
                seed = seed_of_run(run, label, place, "")
                if seed is not None and finals.pop(run):  # an unfinished one: not yet done
                    status.transfers_done.setdefault(place, []).append(seed)
        for seeds in status.transfers_done.values():
            seeds.sort()
        status.finals_done.sort()
        status.finals_started.sort()
        statuses.append(status)
    return statuses, sorted(finals)


def _trial_client_rounds(runs: list[Path], label: str, setup: str, number: int) -> int:
    """The client-rounds the run of trial ``number`` of the (label, setup) study has run so
    far, found among the trials' ``runs`` (0 when it is not there)."""
    tag = f"-t{number:03d}"  # tune's trial runs: run_name(label, setup, tag, tuning seed)
    return sum(
        run_spent(run)["client-rounds"]
        for run in runs
        if seed_of_run(run.name, label, setup, tag) is not None
    )


def _final_runs(root: Path) -> dict[str, bool]:
    """{run name: finished} of the final runs' directories under ``root``."""
    folder = runs_of(root)
    if not folder.is_dir():
        return {}
    return {
        run.name: (run / "summary.json").is_file()
        for run in sorted(folder.iterdir())
        if run.is_dir()
    }


def status_text(statuses: list[StudyStatus], other_finals: list[str]) -> str:
    """The status as a table, a study a row, and the final runs of no study."""
    rows = [
        (
            "study",
            "trials",
            "pruned",
            "failed",
            "running",
            "queued",
            "client-rounds",
            "best (trial)",
            "chosen",
            "finals done",
            "transfer finals done",
        )
    ]
    for s in statuses:
        best = "—" if s.best_score is None else f"{s.best_score:.4f} ({s.best_trial})"
        finals = " ".join(map(str, s.finals_done)) or "—"
        if s.finals_started:
            finals += " (started: " + " ".join(map(str, s.finals_started)) + ")"
        budget = "?" if s.budget is None else str(s.budget)
        rounds = str(s.client_rounds)
        if s.client_rounds_budget:
            rounds += f"/{s.client_rounds_budget}"
        chosen = "—" if s.chosen_trial is None else str(s.chosen_trial)
        if s.chosen_score is not None:
            chosen += f" ({s.chosen_score:.4f} over seeds)"
        moved = "; ".join(
            f"{place.partition(TRANSFER_MARK)[2]}: {' '.join(map(str, seeds))}"
            for place, seeds in sorted(s.transfers_done.items())
        )
        rows.append(
            (
                s.study,
                f"{s.ended}/{budget}",
                str(s.pruned),
                str(s.failed),
                str(s.running),
                str(s.queued),
                rounds,
                best,
                chosen,
                finals,
                moved or "—",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if other_finals:
        lines += ["", "final runs of no study: " + ", ".join(other_finals)]
    return "\n".join(lines)


def foundations_check(root: Path) -> str | None:
    """None when the finished runs (trials and final runs) under ``root`` of each setup and
    data seed share one foundation model, else the mismatch ``tune`` would refuse the
    directory with (``grid_foundations``)."""
    try:
        SetupFoundations.of_finished_runs([runs_of(root / "tuning"), runs_of(root)])
    except FoundationMismatch as err:
        return str(err)
    return None


def main(argv: list[str] | None = None) -> int:
    """Print where a tuning directory stands; exit status 0, or 2 for a directory without a
    readable journal."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.study_status", description=__doc__.split("\n")[0]
    )
    parser.add_argument("directory", type=Path, help="a tune --out or --state directory")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    args = parser.parse_args(argv)
    try:
        statuses, other_finals = directory_status(args.directory)
    except StateError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    mixed = foundations_check(args.directory)
    if args.json:
        document = {
            "studies": [{**asdict(s), "ended": s.ended} for s in statuses],
            "final-runs-of-no-study": other_finals,
            "foundation-mismatch": mixed,
        }
        print(json.dumps(document, indent=2))
    else:
        print(status_text(statuses, other_finals))
        print(
            "\nfoundation models: one per setup and seed"
            if mixed is None
            else f"\nfoundation models MIXED (tune refuses this directory): {mixed}"
        )
    return 0
