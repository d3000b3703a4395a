"""Tuning: declared search spaces, evaluation on validation data with the test split sealed,
and ``fedfm_flower.study.tune`` end to end (trials, choice, final runs, report, resume)."""

from __future__ import annotations

import json
import math
import time
import tomllib
from pathlib import Path

import pytest
import torch

from fedfm_flower.config.experiment import ConfigError, ExperimentConfig
from fedfm_flower.data.sealed import SealedSplit, SealedSplitError
from fedfm_flower.methods.registry import METHODS
from fedfm_flower.study import search
from fedfm_flower.study.search import (
    Around,
    Choice,
    IntRange,
    LogUniform,
    SearchSpaceError,
    Uniform,
    When,
    resolve_space,
)
from fedfm_flower.study.sweep import CONFIG_ROOT, cell_config
from tests.serial_pool import RunPool, tune_pools
from tests.user_dirs import with_user_dirs

BASE = {"method": "fedprox", "dataset": "digits", "lr": 0.02, "local-epochs": 1}


# --- search spaces ---------------------------------------------------------------------------


def test_around_resolves_to_the_setups_own_scale() -> None:
    space = resolve_space({"lr": Around(10.0, 100.0)}, BASE)
    assert space["lr"] == LogUniform(pytest.approx(0.002), pytest.approx(2.0))
    step_mode = {**BASE, "local-steps": 10}
    steps = resolve_space(search.training_space(step_mode), step_mode)
    assert steps["local-steps"] == IntRange(5, 40, log=True)
    assert "local-epochs" not in steps
    epochs = resolve_space(search.training_space(BASE), BASE)
    assert epochs["local-epochs"] == IntRange(1, 5)


@pytest.mark.parametrize(
    ("space", "message"),
    [
        ({"learning-rate": LogUniform(0.001, 0.1)}, "'learning-rate' is not a run-config key"),
        ({"lr": LogUniform(0.0, 0.1)}, "log-scaled but starts at 0.0"),
        ({"lr": Uniform(0.1, 0.1)}, "'lr' is empty"),
        ({"optimizer": Uniform(0.0, 1.0)}, "the key holds str values"),
        ({"weight-decay": Around()}, "needs the setup's value > 0, got 0.0"),
        ({"fedprox-mu": Uniform(-1.0, 1.0)}, "'fedprox-mu' reaches -1.0"),
        ({"optimizer": Choice(("sgd", "rmsprop"))}, "reaches 'rmsprop'"),
        ({"apfl-alpha": Uniform(0.0, 2.0)}, "'apfl-alpha' reaches 2.0"),
        ({"local-epochs": Choice(())}, "no choices"),
    ],
)
def test_a_bad_space_is_refused_naming_key_and_value(space: dict, message: str) -> None:
    with pytest.raises(SearchSpaceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_space(space, BASE)


def test_every_methods_declared_space_resolves_on_its_setups(tmp_path: Path) -> None:
    checked = set()
    for method, spec in METHODS.items():
        for setup_file in sorted((CONFIG_ROOT / method).glob("*.toml")):
            shared = (CONFIG_ROOT / "setups" / setup_file.name).is_file()
            if not shared and "dataset" not in tomllib.loads(setup_file.read_text()):
                continue  # a variant of the method, not a setup
            base = cell_config(method, setup_file.stem, 0, Path("/tmp/unused"))
            base = with_user_dirs(base, tmp_path)  # the user's copy of a paper's data (FedDPA's)
            space = resolve_space(search.method_space(base), base)
            full = {**ExperimentConfig().to_run_config(), **base}
            applies = {
                key
                for key, rng in spec.search.items()
                if not isinstance(rng, When) or full[rng.key] in rng.values
            }
            assert "lr" in space and applies <= set(space)
            checked.add(method)
    assert {"fedprox", "per-fedavg", "tap", "fedperfix", "pfedseq"} <= checked


def test_per_fedavgs_inner_and_outer_steps_are_searched_where_plain_sgd_trains() -> None:
    """Per-FedAvg's alpha and beta over the same absolute ranges on every setup: its steps are
    plain SGD, so an AdamW setup's small lr does not shrink them (multitask-cpu: lr 3e-4); the
    outer step reaches 0.3 (multitask-cpu chose 0.099 of 0.001-0.1)."""
    for setup_lr, optimizer in ((3e-4, "adamw"), (0.02, "sgd")):
        base = {**BASE, "method": "per-fedavg", "lr": setup_lr, "optimizer": optimizer}
        space = resolve_space(search.method_space(base), base)
        assert space["perfedavg-alpha"] == LogUniform(1e-3, 0.1)
        assert space["perfedavg-beta"] == LogUniform(1e-3, 0.3)
        assert space["perfedavg-alpha"].contains(0.03)  # the value 4 trials never reached


def test_a_conditional_range_is_searched_only_where_its_key_has_effect() -> None:
    """FedDPA's alpha: FedDPA-T mixes with it in training; FedDPA-F only with the fixed
    inference weight (its dynamic weighting's lambda is 1), so only there is it searched."""
    text = {"dataset": "instructions", "backbone": "tiny-llama", "lr": 0.005}
    alpha = Uniform(0.1, 0.9)
    for method, weighting, searched in [
        ("feddpa-t", "dynamic", True),
        ("feddpa-t", "fixed", True),
        ("feddpa-f", "dynamic", False),
        ("feddpa-f", "fixed", True),
    ]:
        base = {**text, "method": method, "feddpa-weighting": weighting}
        space = resolve_space(search.method_space(base), base)
        assert (space.get("feddpa-alpha") == alpha) is searched, (method, weighting)
        assert {"lr", "local-epochs"} <= set(space)
    assert "feddpa-alpha" not in resolve_space(
        search.method_space({**text, "method": "feddpa-f"}), {**text, "method": "feddpa-f"}
    )  # the default weighting is dynamic
    with pytest.raises(SearchSpaceError, match="depends on 'weighting', not a run-config key"):
        resolve_space({"feddpa-alpha": When(alpha, "weighting", ("fixed",))}, text)
    with pytest.raises(SearchSpaceError, match="'feddpa-alpha' reaches 2.0"):
        resolve_space(
            {"feddpa-alpha": When(Uniform(0.0, 2.0), "feddpa-weighting", ("dynamic",))}, text
        )


def test_a_trial_draws_inside_the_space_with_optuna() -> None:
    optuna = pytest.importorskip("optuna")
    space = resolve_space(
        {
            "lr": LogUniform(1e-3, 1e-1),
            "local-epochs": IntRange(1, 3),
            "optimizer": Choice(("sgd", "adam")),
        },
        BASE,
    )
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        values = search.suggest(study.ask(), space)
        assert 1e-3 <= values["lr"] <= 1e-1 and values["local-epochs"] in (1, 2, 3)
        assert values["optimizer"] in ("sgd", "adam")
        ExperimentConfig.from_run_config({**BASE, **values})


# --- the validation split and the sealed test split -------------------------------------------


def test_a_sealed_split_refuses_every_use() -> None:
    sealed = SealedSplit("test", "evaluation-split = val")
    for use in (len, iter, bool, lambda s: s[0], lambda s: s.tensors):
        with pytest.raises(SealedSplitError, match="the test split is sealed"):
            use(sealed)


def test_evaluation_on_val_needs_a_validation_split(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from fedfm_flower.tasks import registry as tasks

    with pytest.raises(ConfigError, match="'evaluation-split' = 'val'.*val-fraction > 0"):
        ExperimentConfig.from_run_config({"evaluation-split": "val"})
    val_run = {"evaluation-split": "val", "val-fraction": 0.1}
    ExperimentConfig.from_run_config(val_run)
    entry = tasks.TASKS["image-classification"]
    monkeypatch.setitem(
        tasks.TASKS, "image-classification", dataclasses.replace(entry, validation=False)
    )
    with pytest.raises(ConfigError, match="task 'image-classification'\\) has no validation"):
        ExperimentConfig.from_run_config(val_run)
    with pytest.raises(ConfigError, match="allowed: test, val"):
        ExperimentConfig.from_run_config({"evaluation-split": "train"})


def test_a_val_run_evaluates_the_validation_rows_only(
    small_run_config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedfm_flower.data.federated import load_client_data
    from fedfm_flower.tasks import training
    from server_apps.inprocess import run_in_process

    evaluated: list[torch.Tensor] = []
    real = training.evaluate

    def spy(task, model, data, **kwargs):  # noqa: ANN001, ANN202
        evaluated.append(data.tensors[0])
        return real(task, model, data, **kwargs)

    monkeypatch.setattr(training, "evaluate", spy)
    config = {
        **small_run_config,
        "method": "fedavg",
        "num-clients": 2,
        "val-fraction": 0.2,
        "evaluation-split": "val",
        "eval-every": 1,
    }
    summary, _ = run_in_process(config, 2)
    assert summary["evaluation-split"] == "val"
    parsed = ExperimentConfig.from_run_config(config)
    splits = [load_client_data(parsed, c, 2) for c in range(2)]

    def same(images: torch.Tensor, split) -> bool:  # noqa: ANN001
        return images.shape == split.tensors[0].shape and torch.equal(images, split.tensors[0])

    # two clients, two rounds, on validation rows (the foundation model's own check of its
    # public test split may be evaluated too); never on a client's test rows
    assert sum(any(same(images, s.val) for s in splits) for images in evaluated) == 2 * 2
    assert not any(same(images, s.test) for images in evaluated for s in splits)


def test_instruction_validation_comes_out_of_train_and_leaves_test_alone() -> None:
    from fedfm_flower.tasks import get_task

    task = get_task("instruction-following")
    for client in range(8):
        plain = ExperimentConfig(dataset="instructions", backbone="tiny-llama")
        with_val = ExperimentConfig(dataset="instructions", backbone="tiny-llama", val_fraction=0.2)
        train, test, val = task._splits(plain, client, 8)
        rest, test_again, held = task._splits(with_val, client, 8)
        assert val == () and test_again == test
        assert len(held) == max(1, int(0.2 * (len(train) + len(test))))
        assert sorted(map(repr, rest + held)) == sorted(map(repr, train))
        assert not set(map(repr, rest)) & set(map(repr, held))


# --- the tuning command ------------------------------------------------------------------------


def _tune_argv(out: Path, cache_dir: Path) -> list[str]:
    return [
        "--methods", "fedprox",
        "--setups", "digits-label-skew",
        "--trials", "2",
        "--sampler", "random",
        "--seeds", "0",
        "--select-top", "1", "--select-seeds", "1",
        "--out", str(out),
        "--set", "num-server-rounds=2", "num-clients=2", f"cache-dir='{cache_dir}'",
        "pretrain-epochs=30",
    ]  # fmt: skip


def study_test_fraction(out: Path) -> float:
    """The test share of the tuned runs' clients (the setup's, or the default's)."""
    (trial, *_) = json.loads((out / "tuning.json").read_text())["studies"][0]["trials"]
    return json.loads((Path(trial["run"]) / "config.json").read_text())["run-config"][
        "test-fraction"
    ]


def test_a_validation_share_of_the_training_examples_becomes_the_configs_share() -> None:
    from fedfm_flower.study.tune import val_share

    assert val_share(0.15, {"test-fraction": 0.8}) == pytest.approx(0.03)  # glyph feature skew
    assert val_share(0.15, {}) == pytest.approx(0.15 * (1 - ExperimentConfig().test_fraction))
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match=f"--val-fraction must lie in \\(0, 1\\), got {bad}"):
            val_share(bad, {})


def test_tune_selects_on_validation_then_runs_the_choice_on_test(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedfm_flower.report.build import main as report_main
    from fedfm_flower.study import tune
    from fedfm_flower.tasks import training

    splits_read: list[str] = []
    real = training.evaluate

    def spy(task, model, data, **kwargs):  # noqa: ANN001, ANN202
        splits_read.append("sealed" if isinstance(data, SealedSplit) else "data")
        return real(task, model, data, **kwargs)

    out = tmp_path / "tuned"
    # The foundation is built before the spy (its build evaluates the public test split), so
    # the test counts the runs' evaluations alone, whichever test warmed the cache.
    from fedfm_flower.models.foundation import ensure_foundation

    warm = {"num-clients": 2, "cache-dir": str(cache_dir), "pretrain-epochs": 30}
    ensure_foundation(
        ExperimentConfig.from_run_config(cell_config("fedprox", "digits-label-skew", 0, out, warm))
    )
    monkeypatch.setattr(training, "evaluate", spy)
    assert tune.main(_tune_argv(out, cache_dir)) == 0

    document = json.loads((out / "tuning.json").read_text())
    (study,) = document["studies"]
    assert study["budget"] == 2 and [t["state"] for t in study["trials"]] == ["complete"] * 2
    assert set(study["space"]) == {"lr", "local-epochs", "fedprox-mu"}
    best = max(study["trials"], key=lambda t: (t["score"], -t["number"]))
    assert study["chosen"] == {"trial": best["number"], "values": best["values"]}
    # the first trial is the untuned run: the setup's own values (pyproject defaults, setup file)
    untuned = ExperimentConfig.from_run_config(
        cell_config("fedprox", "digits-label-skew", 0, out, {"num-clients": 2})
    ).to_run_config()
    assert study["trials"][0]["values"] == {k: untuned[k] for k in study["space"]}
    assert study["trials"][1]["values"] != study["trials"][0]["values"]
    # --val-fraction 0.15 of the training examples: of all examples, 0.15 x (1 - test share)
    share = pytest.approx(0.15 * (1 - study_test_fraction(out)))
    import optuna

    from fedfm_flower.records.results import RunDirectory
    from fedfm_flower.study.pruning import journal_storage

    journal = journal_storage(out / "tuning" / "journal.log")
    reported = optuna.load_study(study_name=study["study"], storage=journal).get_trials()
    for trial in study["trials"]:  # every trial evaluated on validation data, test sealed
        run_config = json.loads((Path(trial["run"]) / "config.json").read_text())["run-config"]
        assert run_config["evaluation-split"] == "val" and run_config["val-fraction"] == share
        summary = json.loads((Path(trial["run"]) / "summary.json").read_text())
        assert summary["final-test-accuracy-mean"] == pytest.approx(trial["score"])
        assert all(run_config[k] == v for k, v in trial["values"].items())
        # the run reported each evaluated round to its trial (the default pruner's input)
        rounds = RunDirectory(Path(trial["run"])).rounds()
        values = {r["round"]: r["test-accuracy-mean"] for r in rounds}
        assert reported[trial["number"]].intermediate_values == values and len(values) == 2
        assert trial["rounds"] == 2 and trial["client-rounds"] == 2 * 2
    # the best trial re-ran at seed 1 on the trials' data and validation split (selection)
    rerun = out / "tuning" / "runs" / f"fedprox-digits-label-skew-t{best['number']:03d}-s1"
    rerun_config = json.loads((rerun / "config.json").read_text())["run-config"]
    assert (rerun_config["seed"], rerun_config["data-seed"]) == (1, 0)
    assert rerun_config["evaluation-split"] == "val" and rerun_config["val-fraction"] == share
    assert all(rerun_config[k] == v for k, v in best["values"].items())
    assert study["selection"]["candidates"][0]["trial"] == best["number"]
    assert study["spent"]["client-rounds"] == 2 * 2 * 2 + 2 * 2 and study["spent"]["pruned"] == 0
    assert study["spent"]["reruns"] == 1 and study["spent"]["rerun-client-rounds"] == 2 * 2

    final = out / "runs" / "fedprox-digits-label-skew-s0"
    final_config = json.loads((final / "config.json").read_text())["run-config"]
    assert final_config["evaluation-split"] == "test" and final_config["val-fraction"] == share
    assert all(final_config[k] == v for k, v in best["values"].items())
    # 2 trials and 1 re-run x 2 rounds x 2 clients on validation, then 2 x 2 on test;
    # nothing sealed read
    assert splits_read == ["data"] * (3 * 4 + 4)

    report = tmp_path / "report"
    assert report_main([str(out), "--out", str(report), "--reference", "fedprox"]) == 0
    numbers = json.loads((report / "report.json").read_text())
    assert numbers["runs"] == [str(final.resolve())]  # the trials' runs are not in the tables
    assert "## Tuning" in (report / "report.md").read_text()

    # rerunning resumes: no new trial is drawn, nothing is run again
    (out / "tuning.json").unlink()
    splits_read.clear()
    assert tune.main(_tune_argv(out, cache_dir)) == 0
    assert splits_read == []
    again = json.loads((out / "tuning.json").read_text())["studies"][0]
    assert again["trials"] == study["trials"] and again["chosen"] == study["chosen"]


def test_a_run_ends_after_the_round_its_early_stop_answers_true(
    small_run_config: dict, tmp_path: Path
) -> None:
    from fedfm_flower.records.results import RunDirectory
    from server_apps.inprocess import run_in_process

    heard: list[tuple[int, float]] = []

    def stop(server_round: int, value: float) -> bool:
        heard.append((server_round, value))
        return True

    config = {**small_run_config, "num-clients": 2, "num-server-rounds": 3, "run-name": "cut"}
    summary, _ = run_in_process(config, 2, early_stop=stop)
    rounds = RunDirectory(tmp_path / "runs" / "cut").rounds()
    # fused evaluation: round 1's comes with round 2's messages, so the run ends after round 2
    assert heard == [(1, rounds[0]["test-accuracy-mean"])]
    assert summary["stopped-at-round"] == 1 and summary["rounds"] == len(rounds) == 2
    assert summary["final-test-accuracy-mean"] == heard[0][1]


def test_tune_refuses_a_bad_space_before_any_trial(tmp_path: Path, capsys) -> None:
    from fedfm_flower.study import tune

    argv = ["--methods", "fedprox", "--setups", "digits-label-skew", "--trials", "2"]
    assert tune.main([*argv, "--out", str(tmp_path / "o"), "--set", "lr=0", "num-clients=2"]) == 2
    assert "'lr' = 0.0" in capsys.readouterr().err
    assert tune.main([*argv[:-1], "0", "--out", str(tmp_path / "p"), "--set", "num-clients=2"]) == 2
    assert "--trials must be >= 1" in capsys.readouterr().err


class _OutOfOrderPool:
    """A pool that holds ``capacity`` cells and finishes the newest first, scoring each cell by
    a known function of its values (no run): the scheduling of ``run_trials`` alone."""

    def __init__(self, capacity: int, score) -> None:  # noqa: ANN001
        self.held: list = []
        self.most_held = 0
        self.submitted: list = []
        self.finished: list = []
        self._capacity, self._score = capacity, score

    def capacity(self) -> int:
        return self._capacity

    def submit(self, cell) -> None:  # noqa: ANN001
        self.held.append(cell)
        self.submitted.append(cell)
        self.most_held = max(self.most_held, len(self.held))

    def pending(self) -> int:
        return len(self.held)

    def next_done(self):  # noqa: ANN201
        cell = self.held.pop()
        self.finished.append(cell)
        value = self._score(cell.config)
        record = {"state": "done", "metric": "accuracy", "final": value}
        return cell, {**record, "run": str(cell.run_dir), "state-before": "new"}

    def close(self) -> None:
        pass


def _studies(tmp_path: Path, trials: int):  # noqa: ANN202
    from fedfm_flower.study import tune

    args = _tune_args(tmp_path, trials)
    return tune.open_studies(["fedavg", "fedprox"], ["digits-label-skew"], args, {"num-clients": 2})


def _tune_args(out: Path, trials: int, **options):  # noqa: ANN003, ANN202
    """The tuning command's arguments (``open_studies``, ``write_tuning``), random search."""
    import argparse

    args = argparse.Namespace(
        out=out, tune_seed=0, val_fraction=0.15, tag="", configs=CONFIG_ROOT, sampler="random",
        trials=trials, setup_first=True, variants_at_parent=False, seeds=[0], state=None,
        pruner="none", prune_min_rounds=None, prune_reduction=3, client_rounds=0,
        select_top=0, select_seeds=None, select_last_rounds=2, diverge_drop=0.1,
        data_seeds=None, transfer=[],
    )  # fmt: skip
    for key, value in options.items():
        setattr(args, key, value)
    return args


def test_parallel_trials_keep_the_budget_and_score_every_trial(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    def score(config: dict) -> float:  # best at lr = 0.02, whatever else
        return -abs(math.log(config["lr"] / 0.02))

    studies = _studies(tmp_path, trials=5)
    pool = _OutOfOrderPool(capacity=3, score=score)
    tune.run_trials(studies, pool)
    assert pool.most_held == 3 and len(pool.submitted) == 2 * 5
    for study in studies:
        trials = study.optuna_study.get_trials()
        assert [t.state.name for t in trials] == ["COMPLETE"] * 5
        for trial in trials:  # each trial scored by its own values
            assert trial.value == pytest.approx(score({**study.base, **trial.params}))
        assert study.best().value == max(t.value for t in trials)
    record = tune.study_record(studies[1])
    assert set(record["space"]) == {"lr", "local-epochs", "fedprox-mu"}
    assert record["chosen"]["values"] == studies[1].best().params


def test_a_studys_final_runs_start_while_other_studies_still_run_trials(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune
    from fedfm_flower.study.sweep import SweepLog

    studies = _studies(tmp_path, trials=2)
    pool = _OutOfOrderPool(capacity=3, score=lambda config: config["lr"])
    written: list[int] = []
    finals = tune.FinalRuns(
        [0, 1], tmp_path, {"num-clients": 2}, CONFIG_ROOT, SweepLog(tmp_path, 4),
        on_study_done=lambda: written.append(len(written)),
    )  # fmt: skip
    tune.run_trials(studies, pool, finals)
    fedavg, fedprox = studies
    assert not finals.errors and written == [0, 1]  # tuning.json rewritten as each study ended
    order = [cell.run_dir for cell in pool.finished]

    def last_trial(study: tune.Study) -> int:  # when its last trial finished
        trials = study.optuna_study.get_trials()
        return max(order.index(study.trial_cell(t.number, t.params).run_dir) for t in trials)

    def final_runs(study: tune.Study) -> list[int]:  # when its final runs finished
        done = enumerate(pool.finished)
        return [i for i, cell in done if finals.owns(cell) and cell.label == study.label]

    for study in studies:
        final = final_runs(study)
        assert len(final) == 2 and min(final) > last_trial(study)  # after its own trials only
        for i in final:  # the chosen values, at each seed, on test
            config = pool.finished[i].config
            assert config["lr"] == study.best().params["lr"]
            assert config.get("evaluation-split", "test") == "test"
    # The pool finishes the newest cell first: fedprox's trials end first, and its final runs
    # ran while fedavg's trials were still in flight.
    assert min(final_runs(fedprox)) < last_trial(fedavg)
    assert pool.most_held == 3 and len(pool.submitted) == 2 * 2 + 2 * 2
    recorded = json.loads((tmp_path / "sweep.json").read_text())["cells"]
    assert sorted(r["run"] for r in recorded) == sorted(str(d) for d in finals.records)
    assert len(finals.records) == 4


def test_ctrl_c_closes_the_pool_and_says_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    class Interrupted(_OutOfOrderPool):
        closed = False

        def next_done(self):  # noqa: ANN201
            time.sleep(0.2)  # the command runs a while (tuning.json keeps tenths of seconds)
            raise KeyboardInterrupt

        def close(self) -> None:
            self.closed = True

    pool = Interrupted(capacity=2, score=lambda config: 0.0)
    monkeypatch.setattr(tune, "pool_from_arguments", lambda args: pool)
    argv = ["--methods", "fedavg", "--setups", "digits-label-skew", "--trials", "2"]
    earlier = {"wall-seconds": 100.0, "studies": []}  # an earlier command's 100 s
    (tmp_path / "tuning.json").write_text(json.dumps(earlier))
    assert tune.main([*argv, "--out", str(tmp_path), "--set", "num-clients=2"]) == 130
    assert pool.closed and len(pool.submitted) == 2
    assert "interrupted: rerun the same command to resume" in capsys.readouterr().err
    # the stopped command's time is kept with the earlier ones, its trials as running
    document = json.loads((tmp_path / "tuning.json").read_text())
    assert document["wall-seconds"] >= 100.2
    (study,) = document["studies"]
    assert [t["state"] for t in study["trials"]] == ["running", "running"]


def test_tuning_json_keeps_the_studies_of_earlier_commands(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    fedavg, fedprox = _studies(tmp_path, trials=2)
    tune.run_trials([fedavg, fedprox], _OutOfOrderPool(capacity=2, score=lambda c: c["lr"]))
    args = _tune_args(tmp_path, trials=2)
    tune.write_tuning([fedavg, fedprox], tmp_path, args)
    before = json.loads((tmp_path / "tuning.json").read_text())["studies"]
    tune.write_tuning([fedprox], tmp_path, args)  # a later command names one of the two
    after = json.loads((tmp_path / "tuning.json").read_text())["studies"]
    assert after == before and [r["study"] for r in after] == [fedavg.name, fedprox.name]


def test_a_resumed_studys_time_left_starts_from_the_seconds_its_ended_trials_ran(
    tmp_path: Path,
) -> None:
    optuna = pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    fedavg, fedprox = _studies(tmp_path, trials=2)
    tune.run_trials([fedavg, fedprox], _OutOfOrderPool(capacity=2, score=lambda c: c["lr"]))
    rounds_seconds = [(fedavg, [(1.5, 2.0), (4.0,)]), (fedprox, [(), (3.0, 3.0)])]
    for study, per_trial in rounds_seconds:
        for trial, seconds in zip(study.optuna_study.get_trials(), per_trial, strict=True):
            run = study.trial_cell(trial.number, dict(trial.params)).run_dir
            run.mkdir(parents=True, exist_ok=True)  # a trial without rounds adds nothing
            lines = [{"round": r, "round-seconds": t} for r, t in enumerate(seconds, start=1)]
            (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    first = fedavg.optuna_study.trials[0]
    fedavg.optuna_study.add_trial(  # a pruned trial: its study's trials' time, not its finals'
        optuna.trial.create_trial(
            params=first.params,
            distributions=first.distributions,
            state=optuna.trial.TrialState.PRUNED,
        )
    )
    pruned = fedavg.trial_cell(2, first.params).run_dir
    pruned.mkdir(parents=True)
    (pruned / "metrics.jsonl").write_text(json.dumps({"round": 1, "round-seconds": 0.5}) + "\n")
    assert tune.earlier_seconds(list(_studies(tmp_path, trials=3))) == {
        "fedavg digits-label-skew trials": [3.5, 4.0, 0.5],
        "fedavg digits-label-skew": [3.5, 4.0],
        "fedprox digits-label-skew trials": [6.0],
        "fedprox digits-label-skew": [6.0],
    }


def test_a_trial_left_running_is_rerun_with_its_values(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import search, tune

    (first, _) = _studies(tmp_path, trials=2)
    orphan = first.optuna_study.ask()  # a command died while this trial ran
    values = search.suggest(orphan, first.space)
    studies = _studies(tmp_path, trials=2)  # the rerun opens the same journal
    pool = _OutOfOrderPool(capacity=1, score=lambda config: config["lr"])
    tune.run_trials(studies, pool)
    reran = pool.submitted[0]
    assert reran.config["run-name"].endswith(f"-t{orphan.number:03d}-s0")
    assert all(reran.config[k] == v for k, v in values.items())
    trials = studies[0].optuna_study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    assert trials[orphan.number].params == values


def test_a_final_run_made_with_other_values_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    studies = _studies(tmp_path, trials=2)
    tune.run_trials(studies, _OutOfOrderPool(capacity=1, score=lambda config: config["lr"]))
    (cell, *_) = tune.final_cells(studies[:1], [0], tmp_path, {"num-clients": 2}, CONFIG_ROOT)
    assert cell.config["lr"] == studies[0].best().params["lr"]
    cell.run_dir.mkdir(parents=True)
    made = {**cell.config, "lr": cell.config["lr"] / 2}  # an earlier choice
    (cell.run_dir / "config.json").write_text(json.dumps({"run-config": made}))
    with pytest.raises(ValueError, match="was made with other values \\(lr = "):
        tune.final_cells(studies[:1], [0], tmp_path, {"num-clients": 2}, CONFIG_ROOT)
    (cell.run_dir / "config.json").write_text(json.dumps({"run-config": cell.config}))
    assert tune.final_cells(studies[:1], [0], tmp_path, {"num-clients": 2}, CONFIG_ROOT)


def test_a_resumed_study_draws_new_values_not_those_of_the_first_command(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    def lrs(study: tune.Study) -> list[float]:
        return [t.params["lr"] for t in study.optuna_study.get_trials()]

    score = lambda config: config["lr"]  # noqa: E731
    first = _studies(tmp_path, trials=2)[0]
    tune.run_trials([first], _OutOfOrderPool(capacity=1, score=score))
    drawn_first = lrs(first)
    resumed = _studies(tmp_path, trials=4)[0]  # the same command with a larger budget
    tune.run_trials([resumed], _OutOfOrderPool(capacity=1, score=score))
    assert lrs(resumed)[:2] == drawn_first and len(set(lrs(resumed))) == 4
    # A study that an earlier command opened (its setup trial enqueued) but never drew from
    # keeps --tune-seed: it draws what a study run at once draws.
    _studies(tmp_path / "opened", trials=3)
    opened = _studies(tmp_path / "opened", trials=3)[0]
    at_once = _studies(tmp_path / "at-once", trials=3)[0]
    for study in (opened, at_once):
        tune.run_trials([study], _OutOfOrderPool(capacity=1, score=score))
    assert lrs(opened) == lrs(at_once) and len(set(lrs(opened))) == 3


def test_a_samplers_seed_depends_on_the_tuning_seed_the_method_and_the_draws() -> None:
    from fedfm_flower.study.tune import sampler_seed

    seeds = {
        sampler_seed(tune_seed, label, drawn)
        for tune_seed in (7, 8)
        for label in ("fedavg", "fedprox", "fedprox:strong")
        for drawn in (0, 1, 2)
    }
    assert len(seeds) == 2 * 3 * 3
    # SHA-256 of "7:fedavg:0", not Python's hash(): the same in every process and machine
    assert sampler_seed(7, "fedavg", 0) == 0xE94033F5


def _variant_configs(root: Path) -> Path:
    """The project's configs with a FedProx variant that sets a tuned key and another."""
    import shutil

    shutil.copytree(CONFIG_ROOT, root)
    (root / "fedprox" / "strong.toml").write_text("fedprox-mu = 0.5\nweight-decay = 0.001\n")
    return root


def test_a_variant_runs_at_its_methods_chosen_values_without_a_study(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.report.tuning import markdown_tuning
    from fedfm_flower.study import tune
    from fedfm_flower.study.sweep import SweepLog

    configs = _variant_configs(tmp_path / "c")
    args = _tune_args(tmp_path, 2, configs=configs, variants_at_parent=True, seeds=[0, 1])
    labels = ["fedprox:strong", "fedprox"]
    (study,) = tune.open_studies(labels, ["digits-label-skew"], args, {"num-clients": 2})
    assert study.label == "fedprox" and study.ablations == ["fedprox:strong"]
    pool = _OutOfOrderPool(capacity=2, score=lambda config: config["lr"])
    finals = tune.FinalRuns(
        [0, 1], tmp_path, {"num-clients": 2}, args.configs, SweepLog(tmp_path, 4)
    )
    tune.run_trials([study], pool, finals)
    trials = [c for c in pool.submitted if not finals.owns(c)]
    assert len(trials) == 2 and {c.label for c in trials} == {"fedprox"}  # no variant trial
    last_trial = max(pool.finished.index(c) for c in trials)
    runs = {(c.label, c.seed): c.config for c in pool.finished if finals.owns(c)}
    assert sorted(runs) == [
        ("fedprox", 0),
        ("fedprox", 1),
        ("fedprox:strong", 0),
        ("fedprox:strong", 1),
    ]
    assert min(i for i, c in enumerate(pool.finished) if finals.owns(c)) > last_trial
    chosen = study.best().params
    for seed in (0, 1):
        method, variant = runs[("fedprox", seed)], runs[("fedprox:strong", seed)]
        assert all(method[k] == v for k, v in chosen.items())
        assert variant["val-fraction"] == method["val-fraction"] == study.base["val-fraction"]
        assert variant["fedprox-mu"] == 0.5 and variant["weight-decay"] == 0.001  # its own keys
        differ = {k for k in {*method, *variant} if method.get(k) != variant.get(k)}
        assert differ <= {"fedprox-mu", "weight-decay", "label", "run-name"}, differ

    tune.write_tuning([study], tmp_path, args)
    records = {r["study"]: r for r in json.loads((tmp_path / "tuning.json").read_text())["studies"]}
    variant_record = records["fedprox:strong@digits-label-skew"]
    assert variant_record["values-of"] == study.name and variant_record["trials"] == []
    assert records[study.name]["ablations"] == ["fedprox:strong"]
    study.ablations = []  # a later command names the method alone: the list is kept
    tune.write_tuning([study], tmp_path, args)
    document = json.loads((tmp_path / "tuning.json").read_text())
    assert {r["study"]: r for r in document["studies"]}[study.name]["ablations"] == [
        "fedprox:strong"
    ]
    table = markdown_tuning(document)
    assert (
        "| fedprox:strong | digits-label-skew | none: the values of fedprox@digits-label-skew |"
        in table
    )
    assert "### fedprox:strong" not in table


def test_a_variant_whose_method_is_not_named_is_refused_before_any_run(
    tmp_path: Path, capsys
) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    argv = ["--methods", "fedavg", "tap:all-pairs", "--setups", "digits-label-skew"]
    argv += ["--trials", "2", "--variants-at-parent", "--out", str(tmp_path / "o")]
    assert tune.main([*argv, "--set", "num-clients=2"]) == 2
    assert "'tap:all-pairs' runs at the values chosen for 'tap'" in capsys.readouterr().err
    assert not (tmp_path / "o" / "tuning").exists()


# --- pruning, budgets, per-method draws, coverage, a study's state on another machine ---------


def test_a_trial_worst_at_its_first_report_is_pruned_and_its_rounds_count(
    tmp_path: Path,
) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    args = _tune_args(tmp_path, 3, pruner="halving", prune_min_rounds=1, prune_reduction=2)
    overrides = {"num-clients": 2, "num-server-rounds": 3}
    (study,) = tune.open_studies(["fedavg"], ["digits-label-skew"], args, overrides)
    first = {0: 0.5, 1: 0.1, 2: 0.6}  # each trial's value at round 1, then + 0.1 a round
    pool = RunPool(lambda trial, r: first[trial] + 0.1 * r)
    tune.run_trials([study], pool)

    trials = study.optuna_study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "COMPLETE"]
    # trial 1 reported 0.2 < trial 0's 0.6 at round 1 (the first rung) and ran no further
    assert trials[1].intermediate_values == {1: pytest.approx(0.2)}
    assert trials[0].intermediate_values == pytest.approx({1: 0.6, 2: 0.7, 3: 0.8})
    assert pool.ran[1].endswith("-t001-s0") and len(pool.ran) == 3
    record = tune.study_record(study)
    pruned = record["trials"][1]
    assert pruned["state"] == "pruned" and pruned["score"] is None
    assert pruned["last-round"] == 1 and pruned["last-value"] == pytest.approx(0.2)
    assert [t["rounds"] for t in record["trials"]] == [3, 1, 3]
    assert [t["client-rounds"] for t in record["trials"]] == [6, 2, 6]
    assert record["spent"] == {
        "trials": 3, "pruned": 1, "reruns": 0, "rerun-client-rounds": 0, "rounds": 7,
        "client-rounds": 14, "seconds": 3.5,
    }  # fmt: skip
    assert record["pruner"] == {"name": "halving", "min-rounds": 1, "reduction": 2}
    assert record["chosen"]["trial"] == 2 and record["best-score"] == pytest.approx(0.9)
    # the study's trials ran with this pruner: a command asking for another one is refused,
    # and so is a new method of the same table (setup) asking for another one
    other = _tune_args(tmp_path, 3, pruner="halving", prune_min_rounds=1, prune_reduction=3)
    with pytest.raises(ValueError, match="ran its trials with pruner .*'reduction': 2"):
        tune.open_studies(["fedavg"], ["digits-label-skew"], other, overrides)
    with pytest.raises(ValueError, match="study fedavg@digits-label-skew of this table ran"):
        tune.open_studies(["local"], ["digits-label-skew"], other, overrides)
    same = _tune_args(tmp_path, 3, pruner="halving", prune_min_rounds=1, prune_reduction=2)
    assert len(tune.open_studies(["local"], ["digits-label-skew"], same, overrides)) == 1
    assert tune.open_studies(["local"], ["digits-feature-skew"], other, overrides)  # another


def test_pruner_settings_default_to_the_setups_eval_every_and_refuse_bad_values(
    tmp_path: Path, capsys
) -> None:
    from fedfm_flower.study.pruning import PrunerSettings
    from fedfm_flower.study.tune import main, setup_pruner

    bases = [{"eval-every": 5}, {"eval-every": 10}, {}]
    assert setup_pruner(_tune_args(tmp_path, 1, pruner="halving"), bases).min_rounds == 10
    pinned = _tune_args(tmp_path, 1, pruner="hyperband", prune_min_rounds=2)
    assert setup_pruner(pinned, bases) == PrunerSettings("hyperband", 2, 3)
    with pytest.raises(ValueError, match="--pruner 'asha' unknown; known: halving, hyperband"):
        PrunerSettings("asha")
    argv = ["--methods", "fedavg", "--setups", "digits-label-skew", "--trials", "2"]
    argv += ["--out", str(tmp_path / "o"), "--set", "num-clients=2"]
    assert main([*argv, "--prune-reduction", "1"]) == 2
    assert "--prune-reduction must be >= 2, got 1" in capsys.readouterr().err
    assert main([*argv, "--prune-min-rounds", "0"]) == 2
    assert "--prune-min-rounds must be >= 1, got 0" in capsys.readouterr().err


def test_each_methods_study_draws_its_own_points_and_draws_them_again(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    def drawn(out: Path) -> dict[str, list[float]]:
        studies = _studies(out, trials=4)  # fedavg and fedprox, the setup's values first
        tune.run_trials(studies, _OutOfOrderPool(capacity=1, score=lambda c: c["lr"]))
        return {s.label: [t.params["lr"] for t in s.optuna_study.get_trials()] for s in studies}

    first, again = drawn(tmp_path / "a"), drawn(tmp_path / "b")
    assert first == again  # the same draws in a fresh directory
    fedavg, fedprox = first["fedavg"], first["fedprox"]
    assert fedavg[0] == fedprox[0]  # trial 0: the setup's own lr
    assert len(set(fedavg[1:])) == 3 and not set(fedavg[1:]) & set(fedprox[1:])


def _coverage_record(label: str, chosen: float, tried: dict[str, float]) -> dict:
    """A ``tuning.json`` study record whose trials tried ``tried`` (lr by state)."""
    trials = [
        {"number": i, "values": {"lr": lr, "local-epochs": 1}, "score": 0.5, "state": state}
        for i, (state, lr) in enumerate(tried.items())
    ]
    return {
        "study": f"{label}@multitask-cpu", "label": label, "setup": "multitask-cpu",
        "space": {"lr": "log-uniform [1e-05, 0.01]", "local-epochs": "int [1, 3]"},
        "trials": trials, "best-score": 0.5,
        "chosen": {"trial": 0, "values": {"lr": chosen, "local-epochs": 1}},
    }  # fmt: skip


def _tuning_document(trials: int, studies: list[dict]) -> dict:
    """A ``tuning.json`` document of random search over ``studies``."""
    return {
        "trials-per-study": trials, "sampler": "random", "tuning-seed": 0, "final-seeds": [0],
        "selection": "final mean", "studies": studies,
    }  # fmt: skip


def test_a_choice_outside_the_range_its_rival_tried_is_flagged() -> None:
    from fedfm_flower.report.tuning import coverage_flags, markdown_tuning

    tap = _coverage_record("tap", 0.00137, {"complete": 0.00137, "pruned": 1e-4})
    # FedAvg tried 6e-5..4.8e-4 (a failed trial at 0.01 tried nothing)
    fedavg = _coverage_record("fedavg", 4.8e-4, {"complete": 4.8e-4, "pruned": 6e-5, "fail": 0.01})
    flags = coverage_flags([tap, fedavg], "tap")
    assert flags == {
        "fedavg@multitask-cpu": ["tap's `lr` = 0.00137 outside the tried 6e-05-0.00048"]
    }
    # the reverse: FedAvg's choice outside TAP's tried range, seen from FedAvg as the reference
    assert coverage_flags([tap, fedavg], "fedavg") == {
        "tap@multitask-cpu": ["`lr` = 0.00137 outside fedavg's tried 6e-05-0.00048"]
    }
    covered = _coverage_record("fedavg", 4.8e-4, {"complete": 4.8e-4, "pruned": 0.002})
    assert coverage_flags([tap, covered], "tap") == {"fedavg@multitask-cpu": []}
    document = _tuning_document(2, [tap, fedavg])
    table = markdown_tuning(document, "tap")
    assert "| outside tap's tried range |" in table
    assert (
        "| 3 (1, 1) | — | — | tap's `lr` = 0.00137 outside the tried 6e-05-0.00048 | no |" in table
    )
    assert "Tried: `lr` 6e-05-0.00048; `local-epochs` 1-1." in table  # pruned ones count
    document["studies"] = [tap, covered]
    assert "| 2 (1, 0) | — | — | no | no |" in markdown_tuning(document, "tap")


def test_a_choice_at_an_end_of_its_space_is_flagged_on_the_spaces_scale() -> None:
    """Within 5% of the span from an end, on a log scale for a log range: FedAvg's lr 0.0098 of
    [1e-5, 0.01] and 3 epochs of [1, 3] are at the top, an lr of 1.3e-5 at the bottom; 1 epoch
    (nothing below it), a mid-range lr and a choice are not flagged."""
    import math

    from fedfm_flower.report.tuning import EDGE_SHARE, edge_flags, markdown_tuning
    from fedfm_flower.study.search import space_position

    assert space_position(1e-4, "log-uniform [1e-05, 0.01]") == pytest.approx(1 / 3)
    top = (math.log(0.0098) - math.log(1e-5)) / (math.log(0.01) - math.log(1e-5))
    assert (
        1 - EDGE_SHARE < top == pytest.approx(space_position(0.0098, "log-uniform [1e-05, 0.01]"))
    )
    assert space_position(0.3, "uniform [0.2, 0.7]") == pytest.approx(0.2)
    assert space_position(2, "one of 1, 2") is None
    high = _coverage_record("fedavg", 0.0098, {"complete": 0.0098})
    high["chosen"]["values"]["local-epochs"] = 3
    low = _coverage_record("fedprox", 1.3e-5, {"complete": 1.3e-5})
    low["space"]["mu"], low["chosen"]["values"]["mu"] = "one of 0.01, 0.1", 0.1
    middle = _coverage_record("tap", 0.00137, {"complete": 0.00137})
    assert edge_flags([high, low, middle]) == {
        "fedavg@multitask-cpu": [
            "`lr` = 0.0098 at the top of log-uniform [1e-05, 0.01]",
            "`local-epochs` = 3 at the top of int [1, 3]",
        ],
        "fedprox@multitask-cpu": ["`lr` = 1.3e-05 at the bottom of log-uniform [1e-05, 0.01]"],
        "tap@multitask-cpu": [],
    }
    table = markdown_tuning(_tuning_document(1, [high, middle]), "tap")
    assert "| at an end of its space |" in table
    assert (
        table.count(
            " | `lr` = 0.0098 at the top of log-uniform [1e-05, 0.01]; "
            "`local-epochs` = 3 at the top of int [1, 3] |\n"
        )
        == 1
    )  # the last column of fedavg's row
    assert "| 1 (0, 0) | — | — | — | no |" in table  # the reference (no rival), mid-range


def test_a_study_copied_to_a_fresh_directory_resumes_without_repeating_a_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("optuna")
    import shutil

    from fedfm_flower.study import tune

    pools = tune_pools(monkeypatch, lambda trial, r: 0.9 if trial in (0, -1) else 0.3)
    argv = _copied_study_argv
    assert tune.main(argv(tmp_path / "out", tmp_path / "state", 2)) == 0
    t = "fedavg-digits-label-skew-t{:03d}-s0"
    assert pools[0].ran == [t.format(0), t.format(1), "fedavg-digits-label-skew-s0"]
    state = tmp_path / "state"
    assert (state / "tuning" / "journal.log").is_file()
    assert not (tmp_path / "out" / "tuning" / "journal.log").exists()
    assert (state / "tuning" / "runs" / t.format(1) / "summary.json").is_file()
    assert (state / "runs" / "fedavg-digits-label-skew-s0" / "metrics.jsonl").is_file()

    moved = tmp_path / "elsewhere" / "state"  # the committed state, on a new machine
    shutil.copytree(state, moved)
    assert tune.main(argv(tmp_path / "fresh", moved, 3)) == 0
    assert pools[1].ran == [t.format(2)]  # the new trial only: nothing finished runs again
    document = json.loads((tmp_path / "fresh" / "tuning.json").read_text())
    assert json.loads((moved / "tuning.json").read_text()) == document
    (study,) = document["studies"]
    # the default pruner (halving, first rung at eval-every = 1): 0.3 < 0.9 stops at round 1
    assert [x["state"] for x in study["trials"]] == ["complete", "pruned", "pruned"]
    assert study["spent"]["client-rounds"] == (2 + 1 + 1) * 2 == document["spent"]["client-rounds"]
    assert study["chosen"]["trial"] == 0


def test_a_client_round_budget_draws_trials_past_the_trial_budget_until_it_is_spent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    # trial 0 runs both rounds (4 client-rounds); the halving pruner stops every other trial
    # after round 1 (2 client-rounds)
    pools = tune_pools(monkeypatch, lambda trial, r: 0.9 if trial in (0, -1) else 0.3)
    argv = _copied_study_argv(tmp_path / "out", tmp_path / "state", 2)
    assert tune.main(argv) == 0
    first = json.loads((tmp_path / "out" / "tuning.json").read_text())["studies"][0]
    assert first["spent"]["client-rounds"] == 4 + 2 and first["client-rounds-budget"] == 0

    # the same table topped up to 12 client-rounds: 6 more, at most 4 a trial, 2 each spent
    assert tune.main([*argv, "--client-rounds", "12"]) == 0
    t = "fedavg-digits-label-skew-t{:03d}-s0"
    assert pools[1].ran == [t.format(2), t.format(3), t.format(4)]  # the final run reused
    document = json.loads((tmp_path / "out" / "tuning.json").read_text())
    (study,) = document["studies"]
    assert study["spent"]["client-rounds"] == 12 and study["spent"]["trials"] == 5
    assert study["client-rounds-budget"] == 12 == document["client-rounds-per-study"]
    from fedfm_flower.report.tuning import markdown_tuning

    assert "2 trials and at least 12 client-rounds (trials drawn" in markdown_tuning(document)

    assert tune.main([*argv, "--client-rounds", "12"]) == 0  # spent: nothing more runs
    assert pools[2].ran == []
    assert tune.main([*argv, "--client-rounds", "-1"]) == 2


def test_studies_with_different_client_round_budgets_state_each_their_own() -> None:
    """A directory whose studies came from commands with different --client-rounds (FedDPA's
    Centralized at 16 trials beside the others at 1,024): the report does not claim the last
    command's budget for every study; each row says spent / budget."""
    from fedfm_flower.report.tuning import markdown_tuning
    from fedfm_flower.study.state import client_round_budgets

    spent = {"trials": 2, "pruned": 1, "rounds": 3, "client-rounds": 24, "seconds": 6.0}
    pooled = {
        **_coverage_record("centralized", 1e-3, {"complete": 1e-3}),
        "spent": {**spent, "client-rounds": 3},
    }
    federated = {**_coverage_record("fedavg", 1e-3, {"complete": 1e-3}), "spent": spent}
    pooled["client-rounds-budget"], federated["client-rounds-budget"] = 0, 24
    document = {**_tuning_document(2, [federated, pooled]), "client-rounds-per-study": 24}
    assert client_round_budgets(document) == {
        "fedavg@multitask-cpu": 24,
        "centralized@multitask-cpu": 0,
    }
    table = markdown_tuning(document)
    assert "at least 24 client-rounds" not in table
    assert "each study's budget in client-rounds where it has one" in table
    assert "| 1 (0, 0) | 24 / 24 |" in table and "| 1 (0, 0) | 3 / none |" in table

    pooled["client-rounds-budget"] = 24  # one budget for all: stated once, rows unchanged
    table = markdown_tuning(document)
    assert "2 trials and at least 24 client-rounds (trials drawn" in table
    assert "| 1 (0, 0) | 24 |" in table and "| 1 (0, 0) | 3 |" in table
    del pooled["client-rounds-budget"], federated["client-rounds-budget"]  # an older record
    assert client_round_budgets(document) == {
        "fedavg@multitask-cpu": 24,
        "centralized@multitask-cpu": 24,
    }


def test_a_failed_trials_rounds_still_count_once_its_study_is_copied_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("optuna")
    import shutil

    from fedfm_flower.study import tune

    # trial 1 crashes in round 3 of 3: it ran 2 rounds of 2 clients, and wrote no summary
    pools = tune_pools(monkeypatch, lambda trial, r: None if (trial, r) == (1, 3) else 0.9)

    def argv(out: Path, state: Path) -> list[str]:
        return [*_copied_study_argv(out, state, 2), "num-server-rounds=3", "--pruner", "none"]

    first = tune.main(argv(tmp_path / "out", tmp_path / "state"))
    failed = tmp_path / "state" / "tuning" / "runs" / "fedavg-digits-label-skew-t001-s0"
    assert sorted(p.name for p in failed.iterdir()) == ["config.json", "metrics.jsonl"]

    moved = tmp_path / "elsewhere"  # the committed state, on a new machine
    shutil.copytree(tmp_path / "state", moved)
    again = tune.main(argv(tmp_path / "fresh", moved))
    assert pools[1].ran == []  # nothing runs again, the failed trial neither
    assert (first, again) == (0, 0)  # a failed trial is spent budget, not a failed command
    (study,) = json.loads((tmp_path / "fresh" / "tuning.json").read_text())["studies"]
    assert [t["state"] for t in study["trials"]] == ["complete", "fail"]
    assert [t["client-rounds"] for t in study["trials"]] == [3 * 2, 2 * 2]
    assert study["spent"]["client-rounds"] == 10


def _copied_study_argv(out: Path, state: Path, trials: int) -> list[str]:
    return [
        "--methods", "fedavg", "--setups", "digits-label-skew", "--sampler", "random",
        "--trials", str(trials), "--seeds", "0", "--out", str(out), "--state", str(state),
        "--select-top", "0", "--set", "num-clients=2", "num-server-rounds=2",
    ]  # fmt: skip


def _journal_records(journal: Path) -> list[dict]:
    return [json.loads(line) for line in journal.read_text().splitlines()]


def test_a_journal_record_cut_short_is_dropped_and_the_study_resumes_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    pools = tune_pools(monkeypatch, lambda trial, r: 0.9 if trial in (0, -1) else 0.3)
    state = tmp_path / "state"
    assert tune.main(_copied_study_argv(tmp_path / "out", state, 2)) == 0
    journal = state / "tuning" / "journal.log"
    whole = journal.read_bytes()
    records = _journal_records(journal)
    cut = whole + b'{"op_code": 4, "worker_id": "a-killed-wri'  # a write that never finished
    journal.write_bytes(cut)

    # Optuna alone skips the cut record, then appends the next one to its bytes: one broken
    # line, and the command after fails. Dropped first, every later command reads the journal.
    assert tune.main(_copied_study_argv(tmp_path / "out2", state, 3)) == 0
    assert journal.read_bytes().startswith(whole)
    grown = _journal_records(journal)  # every line parses
    assert grown[: len(records)] == records and len(grown) > len(records)
    assert tune.main(_copied_study_argv(tmp_path / "out3", state, 4)) == 0
    assert [p.ran for p in pools[1:]] == [
        ["fedavg-digits-label-skew-t002-s0"],
        ["fedavg-digits-label-skew-t003-s0"],
    ]
    (study,) = json.loads((state / "tuning.json").read_text())["studies"]
    assert [t["number"] for t in study["trials"]] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("damaged", "content", "line"),
    [
        ("tuning/journal.log", "<<<<<<< HEAD\n", 3),  # a merge conflict inside the journal
        ("tuning.json", "{\n<<<<<<< HEAD\n", 2),
        ("tuning/runs/fedavg-digits-label-skew-t001-s0/summary.json", '{"rounds": ', 1),
        ("runs/fedavg-digits-label-skew-s0/metrics.jsonl", "{}\n{cut", 2),
    ],
)
def test_a_damaged_state_file_is_refused_by_name_before_anything_runs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    damaged: str,
    content: str,
    line: int,
) -> None:
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    pools = tune_pools(monkeypatch, lambda trial, r: 0.5)
    state = tmp_path / "state"
    assert tune.main(_copied_study_argv(tmp_path / "out", state, 2)) == 0
    path = state / damaged
    if damaged.endswith("journal.log"):
        kept = path.read_text().splitlines(keepends=True)
        content = "".join(kept[:2]) + content + "".join(kept[2:])
    path.write_text(content)
    before = {p: p.read_bytes() for p in state.rglob("*") if p.is_file()}
    capsys.readouterr()

    assert tune.main(_copied_study_argv(tmp_path / "fresh", state, 3)) == 2
    error = capsys.readouterr().err
    assert f"error: {path}, line {line}: not valid JSON" in error
    assert "nothing was run or written" in error
    assert len(pools) == 1 and not (tmp_path / "fresh" / "tuning.json").exists()
    assert {p: p.read_bytes() for p in state.rglob("*") if p.is_file()} == before


def test_final_runs_draw_their_data_per_seed_or_on_the_data_seeds_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """By default a final run's data seed is its seed (a new partition and foundation build
    per seed: the intervals carry the data's variance); ``--data-seeds`` gives one per seed
    (the trials' data at every seed: ``0 0``). A final run made on another data draw is
    refused at the seed where it differs and reused where it does not; the trials keep the
    tuning seed's data (or the command's ``data-seed``)."""
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune
    from fedfm_flower.study.grid_foundations import run_data_seed

    pools = tune_pools(monkeypatch, lambda trial, r: 0.5)
    argv = [*_copied_study_argv(tmp_path / "out", tmp_path / "out", 1), "--seeds", "0", "1"]
    assert tune.main(argv) == 0
    runs = tmp_path / "out" / "runs"

    def made(seed: int, root: Path = runs) -> tuple[int, int]:
        path = root / f"fedavg-digits-label-skew-s{seed}" / "config.json"
        config = json.loads(path.read_text())["run-config"]
        return config["seed"], config["data-seed"]

    assert [made(0), made(1)] == [(0, 0), (1, 1)]
    document = json.loads((tmp_path / "out" / "tuning.json").read_text())
    assert document["final-data-seeds"] == [0, 1]
    trial = tmp_path / "out" / "tuning" / "runs" / "fedavg-digits-label-skew-t000-s0"
    trial_config = json.loads((trial / "config.json").read_text())["run-config"]
    assert run_data_seed(trial_config) == 0
    capsys.readouterr()
    # the trials' data at every seed, asked for: seed 1's run on its own draw is refused
    assert tune.main([*argv, "--data-seeds", "0", "0"]) == 1
    error = capsys.readouterr().err
    assert "fedavg-digits-label-skew-s1 was made with other values (data-seed = 1, now 0)" in error
    assert "-s0 was made" not in error
    assert pools[1].ran == []
    for bad in (["--data-seeds", "0"], ["--data-seeds", "0", "-1"]):
        assert tune.main([*argv, *bad]) == 2
        assert "--data-seeds" in capsys.readouterr().err
    # data-seed set for the whole command: the trials' data; the final runs draw per seed
    out = tmp_path / "o2"
    argv = [*_copied_study_argv(out, out, 1), "data-seed=4", "--seeds", "0", "1"]
    assert tune.main([*argv, "--data-seeds", "4", "4"]) == 0
    trial = out / "tuning" / "runs" / "fedavg-digits-label-skew-t000-s0"
    assert json.loads((trial / "config.json").read_text())["run-config"]["data-seed"] == 4
    assert [made(0, out / "runs"), made(1, out / "runs")] == [(0, 4), (1, 4)]


def test_the_setups_own_values_are_never_pruned_even_when_a_drawn_trial_reports_first(
    tmp_path: Path,
) -> None:
    """Trials in parallel: drawn trial 1 reaches the first rung (round 5) first with 0.60;
    trial 0, the enqueued setup values, then reports 0.55 there. A drawn trial would be
    pruned; trial 0 goes on, so the choice is never worse than the untuned run."""
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    args = _tune_args(tmp_path, 4, pruner="halving", prune_min_rounds=5, prune_reduction=3)
    overrides = {"num-clients": 2, "num-server-rounds": 20}
    (study,) = tune.open_studies(["fedavg"], ["digits-label-skew"], args, overrides)
    asked = [study.optuna_study.ask() for _ in range(3)]  # 0: enqueued, 1 and 2: drawn
    assert "fixed_params" in study.optuna_study.get_trials()[0].system_attrs
    links = [study.trial_cell(t.number, dict(t.params)).trial for t in asked]
    assert not links[1].early_stop()(5, 0.60)
    assert not links[0].early_stop()(5, 0.55)  # the setup's values: never pruned
    assert links[2].early_stop()(5, 0.55)  # the same value from a drawn trial: pruned


def test_a_pruning_decided_before_a_crash_stops_the_resumed_run() -> None:
    """The pruner records the rung it judged as it decides; a run killed before it stopped
    would, resumed, pass that rung by and run to the next. The decision is kept with the trial,
    so the resumed run stops at its first report."""
    pytest.importorskip("optuna")
    import tempfile

    from fedfm_flower.study import tune
    from fedfm_flower.study.pruning import PRUNED_AT

    with tempfile.TemporaryDirectory() as tmp:
        args = _tune_args(Path(tmp), 3, pruner="halving", prune_min_rounds=5, prune_reduction=3)
        overrides = {"num-clients": 2, "num-server-rounds": 20}
        (study,) = tune.open_studies(["fedavg"], ["digits-label-skew"], args, overrides)
        asked = [study.optuna_study.ask() for _ in range(2)]
        links = [study.trial_cell(t.number, dict(t.params)).trial for t in asked]
        assert not links[0].early_stop()(5, 0.8)
        assert links[1].early_stop()(5, 0.5)  # pruned; the process dies before it stops
        assert study.optuna_study.get_trials()[1].user_attrs[PRUNED_AT] == 5
        resumed = links[1].early_stop()  # the resumed run's next report, rung 0 passed by
        assert resumed(10, 0.9)


def test_a_report_the_journal_cannot_take_leaves_the_run_going_and_the_next_one_is_judged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A journal that cannot be read at one report (here: moved away, as a shared disk that
    drops out) costs that round's judgement, not the trial: the run goes on, the warning names
    the trial, the round and the journal, and the next report is judged as usual."""
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    args = _tune_args(tmp_path, 3, pruner="halving", prune_min_rounds=5, prune_reduction=3)
    overrides = {"num-clients": 2, "num-server-rounds": 20}
    (study,) = tune.open_studies(["fedavg"], ["digits-label-skew"], args, overrides)
    asked = [study.optuna_study.ask() for _ in range(2)]
    links = [study.trial_cell(t.number, dict(t.params)).trial for t in asked]
    assert not links[0].early_stop()(5, 0.8)
    stop = links[1].early_stop()
    journal = Path(links[1].journal)
    journal.rename(journal.with_suffix(".away"))
    with caplog.at_level("WARNING", logger="fedfm_flower.study.pruning"):
        assert not stop(5, 0.5)  # would be pruned: 0.5 < 0.8 at the first rung
    assert f"trial 1 of {links[1].study}: round 5's value 0.5 not reported to {journal}" in (
        caplog.text
    )
    journal.with_suffix(".away").rename(journal)
    assert 5 not in study.optuna_study.get_trials()[1].intermediate_values
    assert stop(10, 0.5)  # judged again: the first rung, with the value it has now
    assert study.optuna_study.get_trials()[1].intermediate_values == {10: 0.5}


def test_a_copied_study_installs_its_foundation_builds_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """On a new machine the kept build goes into the runs' cache; a cache holding another build
    of it stops the command (exit 2) before any run."""
    pytest.importorskip("optuna")
    from fedfm_flower.study import tune

    pools = tune_pools(monkeypatch, lambda trial, r: 0.9)
    kept = tmp_path / "state" / "foundations" / "foundation"
    kept.mkdir(parents=True)
    (kept / "tiny-vit-abc.safetensors").write_bytes(b"the study's build")
    (kept / "tiny-vit-abc.json").write_text('{"key": "abc"}')
    cache = tmp_path / "new-machine-cache"
    argv = [*_copied_study_argv(tmp_path / "out", tmp_path / "state", 1), f"cache-dir='{cache}'"]
    assert tune.main(argv) == 0 and pools[0].ran
    assert (cache / "foundation" / "tiny-vit-abc.safetensors").read_bytes() == b"the study's build"
    assert (cache / "foundation" / "tiny-vit-abc.json").is_file()
    (cache / "foundation" / "tiny-vit-abc.safetensors").write_bytes(b"this machine's build")
    assert tune.main(argv) == 2
    assert len(pools) == 1  # no pool was made: nothing ran
    assert "another build of this foundation" in capsys.readouterr().err


def test_a_study_stops_at_a_run_on_another_foundation_model_and_resumes_once_it_is_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A run on another build than its setup's earlier runs stops the command (exit 1) before
    it is kept or told; the next command refuses before any run (exit 2) until the run of the
    other build is moved away, then the study goes on on the first build."""
    pytest.importorskip("optuna")
    import shutil

    from fedfm_flower.models.foundation_cards import WEIGHTS_SHA256
    from fedfm_flower.study import tune

    first = {"key": "abc", WEIGHTS_SHA256: "1" * 64, "public_test_accuracy": 0.95}
    other = {"key": "abc", WEIGHTS_SHA256: "2" * 64, "public_test_accuracy": 0.94}
    now = [first]
    pools = tune_pools(monkeypatch, lambda trial, r: 0.9, card=lambda: now[0])
    out, state = tmp_path / "out", tmp_path / "state"
    t = "fedavg-digits-label-skew-t{:03d}-s0"
    assert tune.main(_copied_study_argv(out, state, 2)) == 0
    now[0] = other  # the cache now holds another build of the recipe (another machine's)
    assert tune.main(_copied_study_argv(out, state, 3)) == 1
    assert pools[1].ran == [t.format(2)]
    said = capsys.readouterr().err
    assert "two builds of foundation abc" in said and t.format(2) in said
    assert "sha256 111111111111" in said and "sha256 222222222222" in said
    assert not (state / "tuning" / "runs" / t.format(2)).exists()  # not kept
    trials = json.loads((out / "tuning.json").read_text())["studies"][0]["trials"]
    assert len(trials) == 3 and trials[2]["state"] == "running"  # not told
    values = trials[2]["values"]

    assert tune.main(_copied_study_argv(out, state, 3)) == 2
    assert len(pools) == 2  # refused before a pool was made: nothing ran
    assert "two builds of foundation abc" in capsys.readouterr().err

    shutil.rmtree(out / "tuning" / "runs" / t.format(2))
    now[0] = first  # the study's build is back in the cache
    assert tune.main(_copied_study_argv(out, state, 3)) == 0
    assert pools[2].ran == [t.format(2)]  # the trial left running, again with its values
    trials = json.loads((out / "tuning.json").read_text())["studies"][0]["trials"]
    assert [x["state"] for x in trials] == ["complete"] * 3 and trials[2]["values"] == values
    assert (state / "tuning" / "runs" / t.format(2) / "summary.json").is_file()
