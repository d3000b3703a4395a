"""Choosing a study's values (``fedfm_flower.study.selection``, ``tune``): top trials re-run at more
seeds, a diverging run never chosen, the re-runs in the budget; final runs on a transfer setup.

The runs are ``RunPool``'s (no training): each round's validation value is a known function of
the trial, the round and the seed, so every choice is checked against one made by hand.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from fedfm_flower.study.selection import diverged, tail_mean
from fedfm_flower.study.sweep import CONFIG_ROOT
from tests.serial_pool import tune_pools

ROUNDS, CLIENTS = 3, 2


def test_divergence_and_the_tail_mean_by_hand() -> None:
    # best 0.8; floor 0.8 - 0.1 x 0.8 = 0.72: 0.75 holds, 0.70 falls below it
    assert not diverged([0.5, 0.8, 0.75], 0.1)
    assert diverged([0.5, 0.8, 0.70], 0.1)
    assert not diverged([0.3, 0.2, 0.6], 0.1)  # a dip before the best round is no divergence
    assert diverged([0.5, math.nan], 0.1) and diverged([math.inf], 0.1)
    assert diverged([0.5, 0.8, 0.75], 0.05)  # 0.75 < 0.8 x 0.95 = 0.76
    assert tail_mean([0.1, 0.2, 0.3, 0.4], 2) == pytest.approx(0.35)
    assert tail_mean([0.5], 3) == pytest.approx(0.5)
    assert math.isnan(tail_mean([], 2))


def _argv(out: Path, state: Path, trials: int, *extra: str) -> list[str]:
    return [
        "--methods", "fedavg", "--setups", "digits-label-skew", "--sampler", "random",
        "--trials", str(trials), "--seeds", "0", "--out", str(out), "--state", str(state),
        "--pruner", "none", *extra,
        "--set", f"num-clients={CLIENTS}", f"num-server-rounds={ROUNDS}",
    ]  # fmt: skip


def _study(out: Path) -> dict:
    (study,) = json.loads((out / "tuning.json").read_text())["studies"]
    return study


def _final_values(out: Path, study: dict) -> dict:
    config = json.loads((out / "runs" / "fedavg-digits-label-skew-s0" / "config.json").read_text())
    return {k: config["run-config"][k] for k in study["chosen"]["values"]}


# Trial 0 is best at the tuning seed (0.90 at its last round) and collapses at seed 1; trial 1
# ends at 0.85 at every seed; trial 2 at 0.80.
FINAL = {0: 0.90, 1: 0.85, 2: 0.80}


def _edge_of_stability(trial: int, r: int, seed: int) -> float:
    if trial == 0 and seed == 1:
        return [0.5, 0.9, 0.4][r - 1]  # best at round 2, then 0.4 < 0.9 x 0.9: diverged
    return FINAL.get(trial, 0.7) - 0.1 * (ROUNDS - r)


def test_a_study_whose_best_single_seed_trial_diverges_at_another_seed_does_not_choose_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    pools = tune_pools(monkeypatch, _edge_of_stability, seeded=True)
    top2 = ("--select-top", "2", "--select-seeds", "1", "2")
    assert tune.main(_argv(tmp_path / "out", tmp_path / "state", 3, *top2)) == 0
    study = _study(tmp_path / "out")
    scores = {t["number"]: t["score"] for t in study["trials"]}
    assert scores == pytest.approx(FINAL)  # by the single seed, trial 0 would win
    assert study["chosen"]["trial"] == 1
    assert _final_values(tmp_path / "out", study) == study["chosen"]["values"]
    selection = study["selection"]
    by_trial = {c["trial"]: c for c in selection["candidates"]}
    assert sorted(by_trial) == [0, 1]  # the top 2 by single-seed score; trial 2 never re-ran
    assert not by_trial[0]["stable"] and by_trial[0]["score"] is None
    assert [r["diverged"] for r in by_trial[0]["runs"]] == [False, True, False]  # seeds 0 1 2
    # trial 1's score: the mean over 3 seeds of the mean of its last 2 rounds (0.75, 0.85)
    assert by_trial[1]["score"] == pytest.approx(0.80)
    assert study["selection-score"] == pytest.approx(0.80)
    reruns = [n for n in pools[0].ran if "-t" in n and not n.endswith("-s0")]
    assert sorted(reruns) == [
        f"fedavg-digits-label-skew-t00{t}-s{s}" for t in (0, 1) for s in (1, 2)
    ]
    assert study["spent"]["reruns"] == 4
    assert study["spent"]["rerun-client-rounds"] == 4 * ROUNDS * CLIENTS
    assert study["spent"]["client-rounds"] == (3 + 4) * ROUNDS * CLIENTS
    for run in (tmp_path / "out" / "tuning" / "runs").glob("*-t00[01]-s[12]"):
        config = json.loads((run / "config.json").read_text())["run-config"]
        assert config["evaluation-split"] == "val" and config["data-seed"] == 0

    # the report's tuning section says how the choice was made
    from fedfm_flower.report.tuning import markdown_tuning

    text = markdown_tuning(json.loads((tmp_path / "out" / "tuning.json").read_text()), "fedavg")
    assert "| 80.00 (3 seeds; single 85.00) |" in text
    assert "trial 0 diverged at seed 1; trial 1 80.00." in text
    assert "each on its own data draw" not in text  # one final seed: one draw
    assert "on one data draw (data seed 0): intervals carry training only" in text

    # a copy of the state decides alike on another machine, running nothing again
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "state", moved)
    assert tune.main(_argv(tmp_path / "fresh", moved, 3, *top2)) == 0
    assert pools[1].ran == []  # the final run too is restored from the state
    again = _study(tmp_path / "fresh")
    assert again["chosen"] == study["chosen"] and again["selection"] == {
        **study["selection"],
        "candidates": again["selection"]["candidates"],
    }
    assert [c["score"] for c in again["selection"]["candidates"]] == [
        c["score"] for c in selection["candidates"]
    ]

    # the single-seed choice (--select-top 0) takes trial 0: it did not diverge at seed 0
    assert tune.main(_argv(tmp_path / "one", tmp_path / "one", 3, "--select-top", "0")) == 0
    assert _study(tmp_path / "one")["chosen"]["trial"] == 0


def test_a_trial_whose_own_run_collapsed_is_passed_over_and_an_unstable_wave_opens_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    def curve(trial: int, r: int, seed: int) -> float:
        if trial == 0:
            return [0.5, 0.95, 0.8][r - 1]  # best at round 2 then 0.8 < 0.855: passed over
        if trial == 1 and seed == 2:
            return [0.6, 0.6, math.nan][r - 1]  # not finite at seed 2
        return {1: 0.78, 2: 0.75}.get(trial, 0.7) - 0.01 * (ROUNDS - r)

    pools = tune_pools(monkeypatch, curve, seeded=True)
    top1 = ("--select-top", "1", "--select-seeds", "1", "2")
    assert tune.main(_argv(tmp_path / "out", tmp_path / "out", 3, *top1)) == 0
    study = _study(tmp_path / "out")
    selection = study["selection"]
    assert selection["passed-over"] == [0] and selection["waves"] == 2
    assert [c["trial"] for c in selection["candidates"]] == [1, 2]
    assert study["chosen"]["trial"] == 2
    # trial 0 never re-ran; trial 1 re-ran at both seeds (its wave), then trial 2
    reruns = sorted(n for n in pools[0].ran if "-t" in n and not n.endswith("-s0"))
    assert reruns == [f"fedavg-digits-label-skew-t00{t}-s{s}" for t in (1, 2) for s in (1, 2)]


def test_no_stable_trial_leaves_the_study_without_a_choice_and_the_command_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    def curve(trial: int, r: int, seed: int) -> float:
        return [0.9, 0.5, 0.5][r - 1] if seed == 1 else 0.6

    pools = tune_pools(monkeypatch, curve, seeded=True)
    argv = _argv(tmp_path / "out", tmp_path / "out", 2, "--select-top", "1", "--select-seeds", "1")
    assert tune.main(argv) == 1
    assert "study fedavg@digits-label-skew has no stable trial" in capsys.readouterr().err
    study = _study(tmp_path / "out")
    assert study["chosen"] is None and study["selection"]["decided"]
    assert not any(n.endswith("skew-s0") for n in pools[0].ran)  # no final run


def test_a_client_round_budget_leaves_room_for_the_selections_re_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trial and a re-run cost 3 rounds x 2 clients = 6 client-rounds; a budget of 60 with
    2 candidates x 2 seeds keeps 24 for the re-runs, so the study draws 6 trials (36), past its
    trial budget of 1, and spends 60 in all."""
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    tune_pools(monkeypatch, lambda trial, r, seed: 0.5 + 0.01 * trial, seeded=True)
    extra = ("--client-rounds", "60", "--select-top", "2", "--select-seeds", "1", "2")
    assert tune.main(_argv(tmp_path / "out", tmp_path / "out", 1, *extra)) == 0
    study = _study(tmp_path / "out")
    assert len(study["trials"]) == 6
    assert study["spent"]["client-rounds"] == 60 and study["spent"]["reruns"] == 4


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (("--select-top", "-1"), "--select-top must be >= 0, got -1"),
        (("--select-seeds", "0", "1"), "must differ from each other and from the tuning seed 0"),
        (("--select-seeds", "1", "1"), "must differ from each other"),
        (("--select-last-rounds", "0"), "--select-last-rounds must be >= 1, got 0"),
        (("--diverge-drop", "1.5"), "--diverge-drop must lie in (0, 1), got 1.5"),
    ],
)
def test_bad_selection_options_are_refused_before_any_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    bad: tuple[str, ...],
    message: str,
) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    pools = tune_pools(monkeypatch, lambda trial, r, seed: 0.5, seeded=True)
    assert tune.main(_argv(tmp_path / "out", tmp_path / "out", 1, *bad)) == 2
    assert message in capsys.readouterr().err
    assert pools == [] and not (tmp_path / "out" / "tuning.json").exists()


def _configs_with_transfer(root: Path, changes: str) -> Path:
    """A copy of fedavg's digits config with the transfer setup ``strong`` of digits-label-skew."""
    (root / "fedavg").mkdir(parents=True)
    shutil.copy(CONFIG_ROOT / "fedavg" / "digits-label-skew.toml", root / "fedavg")
    (root / "transfer" / "digits-label-skew").mkdir(parents=True)
    (root / "transfer" / "digits-label-skew" / "strong.toml").write_text(changes)
    return root


def test_the_chosen_values_run_unchanged_on_a_transfer_setup_at_every_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    pools = tune_pools(monkeypatch, lambda trial, r, seed: 0.5 + 0.01 * trial, seeded=True)
    configs = _configs_with_transfer(tmp_path / "configs", "dirichlet-alpha = 0.1\n")
    extra = ("--select-top", "0", "--seeds", "0", "1", "--transfer", "strong")
    argv = [*_argv(tmp_path / "out", tmp_path / "out", 2, *extra), "--configs", str(configs)]
    assert tune.main(argv) == 0
    study = _study(tmp_path / "out")
    runs = tmp_path / "out" / "runs"
    for seed in (0, 1):
        base = json.loads((runs / f"fedavg-digits-label-skew-s{seed}/config.json").read_text())
        moved = json.loads(
            (runs / f"fedavg-digits-label-skew~strong-s{seed}/config.json").read_text()
        )
        base, moved = base["run-config"], moved["run-config"]
        assert (moved["setup"], moved["dirichlet-alpha"], base["dirichlet-alpha"]) == (
            "digits-label-skew~strong",
            0.1,
            0.3,
        )
        assert moved["seed"] == moved["data-seed"] == seed == base["data-seed"]
        # everything but the transfer's key and the run's names is the final run's
        differ = {k for k in base if base[k] != moved[k]}
        assert differ == {"setup", "run-name", "dirichlet-alpha"}
        assert {k: moved[k] for k in study["chosen"]["values"]} == study["chosen"]["values"]
    document = json.loads((tmp_path / "out" / "tuning.json").read_text())
    assert document["transfer"] == {"digits-label-skew": ["digits-label-skew~strong"]}
    assert len([n for n in pools[0].ran if "~strong" in n]) == 2

    # the report reads the base setup back from the transfer runs' setup
    from fedfm_flower.report.transfer import transfer_setups

    setups = {
        json.loads((r / "config.json").read_text())["run-config"]["setup"] for r in runs.iterdir()
    }
    assert transfer_setups(setups) == {"digits-label-skew": ["digits-label-skew~strong"]}

    # a transfer file that sets a chosen key, or one that is missing: refused before any run
    capsys.readouterr()
    bad = _configs_with_transfer(tmp_path / "bad", "lr = 0.5\n")
    argv = [*_argv(tmp_path / "o2", tmp_path / "o2", 2, *extra), "--configs", str(bad)]
    assert tune.main(argv) == 2
    assert "strong.toml sets lr, which the study of fedavg chooses" in capsys.readouterr().err
    argv = [*_argv(tmp_path / "o3", tmp_path / "o3", 2, "--transfer", "nowhere")]
    assert tune.main(argv) == 2
    error = capsys.readouterr().err
    assert "--transfer nowhere:" in error and "nowhere.toml does not exist" in error
    assert len(pools) == 1
