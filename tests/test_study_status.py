"""``study_status``: where a tuning directory stands, read from a copy of its journal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedfm_flower.study.status import main

optuna = pytest.importorskip("optuna")


def _tuning_directory(root: Path) -> bytes:
    """A tuning directory: two studies in a journal (one with every trial state), a budget in
    tuning.json for one of them, final runs done, started and of no study; the journal's
    bytes, a record cut short at the end."""
    from fedfm_flower.study.pruning import journal_storage

    journal = root / "tuning" / "journal.log"
    storage = journal_storage(journal)
    states = optuna.trial.TrialState
    dist = {"lr": optuna.distributions.FloatDistribution(1e-4, 1.0, log=True)}
    fedavg = optuna.create_study(study_name="fedavg@toy", storage=storage, direction="maximize")
    for value, lr in ((0.5, 0.01), (0.7, 0.02), (0.7, 0.03)):  # a tie: the lower number wins
        fedavg.add_trial(
            optuna.trial.create_trial(params={"lr": lr}, distributions=dist, value=value)
        )
    fedavg.add_trial(
        optuna.trial.create_trial(
            params={"lr": 0.9},
            distributions=dist,
            state=states.PRUNED,
            intermediate_values={10: 0.9},
        )
    )
    fedavg.add_trial(
        optuna.trial.create_trial(params={"lr": 0.5}, distributions=dist, state=states.FAIL)
    )
    fedavg.ask()  # left running
    local = optuna.create_study(study_name="local@toy-x", storage=storage, direction="maximize")
    local.ask()
    local.enqueue_trial({"lr": 0.01})  # queued, as tune enqueues the setup's values
    tuning = {
        "trials-per-study": 8,
        "client-rounds-per-study": 0,
        "studies": [
            {
                "study": "fedavg@toy",
                "budget": 6,
                "client-rounds-budget": 40,
                "chosen": {"trial": 2, "values": {"lr": 0.03}},  # a selection over seeds
                "selection-score": 0.65,
            }
        ],
        "transfer": {"toy": ["toy~far"]},
    }
    (root / "tuning.json").write_text(json.dumps(tuning))
    for name, done in (
        ("fedavg-toy-s0", True),
        ("fedavg-toy-s2", True),
        ("fedavg-toy-s1", False),
        ("fedavg-vanilla-toy-s0", True),  # a variant's (no study)
        ("local-toy-x-s0", False),
        ("fedavg-toy~far-s0", True),  # on the transfer setup
        ("fedavg-toy~far-s1", True),
        ("fedavg-toy~far-s2", False),
    ):
        run = root / "runs" / name
        run.mkdir(parents=True)
        if done:
            (run / "summary.json").write_text("{}")
    # the trials' runs: their sampled clients summed over the rounds run so far
    for name, sampled in (
        ("fedavg-toy-t000-s0", [3, 3]),
        ("fedavg-toy-t000-s1", [3, 3]),  # a selection's re-run of trial 0
        ("fedavg-toy-t003-s0", [4]),  # the pruned one: the rounds it ran
        ("fedavg-toy-t005-s0", [2, 2, 2]),  # the running one, so far
        ("fedavg-toy-t01-s0", [9]),  # no trial's name: not counted
        ("local-toy-x-t000-s0", [5]),
    ):
        run = root / "tuning" / "runs" / name
        run.mkdir(parents=True)
        lines = [json.dumps({"round": r + 1, "clients-sampled": n}) for r, n in enumerate(sampled)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with journal.open("ab") as handle:
        handle.write(b'{"op_code": 5, "worker_id": "cut')  # a write that never finished
    return journal.read_bytes()


def test_the_status_counts_each_studys_trials_best_and_finals_without_touching_the_journal(
    tmp_path: Path, capsys
) -> None:
    before = _tuning_directory(tmp_path)
    assert main([str(tmp_path), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    fedavg, local = document["studies"]
    assert fedavg["study"] == "fedavg@toy" and fedavg["budget"] == 6
    assert (fedavg["complete"], fedavg["pruned"], fedavg["failed"], fedavg["running"]) == (
        3,
        1,
        1,
        1,
    )
    assert fedavg["ended"] == 5
    assert (fedavg["client_rounds"], fedavg["client_rounds_budget"]) == (6 + 6 + 4 + 6, 40)
    assert (local["client_rounds"], local["client_rounds_budget"]) == (5, 0)
    assert (fedavg["best_trial"], fedavg["best_score"], fedavg["best_values"]) == (
        1,
        0.7,
        {"lr": 0.02},
    )
    assert fedavg["finals_done"] == [0, 2] and fedavg["finals_started"] == [1]
    assert (fedavg["chosen_trial"], fedavg["chosen_score"]) == (2, 0.65)
    assert fedavg["transfers_done"] == {"toy~far": [0, 1]}
    assert local["chosen_trial"] is None and local["transfers_done"] == {}
    assert local["budget"] == 8  # the command's budget where the study has none of its own
    assert (fedavg["running"], fedavg["queued"]) == (1, 0)
    assert (local["ended"], local["running"], local["queued"], local["best_trial"]) == (
        0,
        1,
        1,
        None,
    )
    assert local["finals_done"] == [] and local["finals_started"] == [0]
    assert document["final-runs-of-no-study"] == ["fedavg-vanilla-toy-s0"]
    assert (tmp_path / "tuning" / "journal.log").read_bytes() == before  # read from a copy
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "study",
        "trials",
        "pruned",
        "failed",
        "running",
        "queued",
        "client-rounds",
        "best",
        "(trial)",
        "chosen",
        "finals",
        "done",
        "transfer",
        "finals",
        "done",
    ]
    assert lines[1].split() == [
        "fedavg@toy",
        "5/6",
        "1",
        "1",
        "1",
        "0",
        "22/40",
        "0.7000",
        "(1)",
        "2",
        "(0.6500",
        "over",
        "seeds)",
        "0",
        "2",
        "(started:",
        "1)",
        "far:",
        "0",
        "1",
    ]
    assert lines[2].split() == [
        "local@toy-x",
        "0/8",
        "0",
        "0",
        "1",
        "1",
        "5",
        "—",
        "—",
        "—",
        "(started:",
        "0)",
        "—",
    ]
    assert lines[-3] == "final runs of no study: fedavg-vanilla-toy-s0"
    assert lines[-1] == "foundation models: one per setup and seed"


def test_the_status_says_when_a_setups_runs_ran_on_two_builds(tmp_path: Path, capsys) -> None:
    from tests.test_study_foundations import build, write_run

    _tuning_directory(tmp_path)
    card = build(tmp_path / "cache-a", b"one build")
    write_run(tmp_path / "tuning" / "runs", "fedavg-glyphs-t000-s0", card, tmp_path / "cache-a")
    assert main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["foundation-mismatch"] is None
    other = build(tmp_path / "cache-b", b"another build")
    write_run(tmp_path / "runs", "fedavg-glyphs-s0", other, tmp_path / "cache-b")
    assert main([str(tmp_path)]) == 0
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith("foundation models MIXED (tune refuses this directory): runs of setup")
    assert "two builds of foundation c0ffee" in said and "fedavg-glyphs-s0" in said


def test_a_directory_without_a_journal_is_refused_naming_where_it_looked(
    tmp_path: Path, capsys
) -> None:
    assert main([str(tmp_path)]) == 2
    said = capsys.readouterr().err
    assert f"no Optuna journal at {tmp_path / 'tuning' / 'journal.log'}" in said
    assert "--state keeps its journal there" in said
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / "journal.log").write_text("{not json\n")
    assert main([str(tmp_path)]) == 2
    assert (
        f"{tmp_path / 'tuning' / 'journal.log'}, line 1: not valid JSON" in capsys.readouterr().err
    )
