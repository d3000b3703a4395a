"""The sweep: layered configs, validation before any run, resume, TensorBoard, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedfm_flower.report.build import main as report_main
from fedfm_flower.study import sweep
from tests.serial_pool import QueuePool


def _configs(root: Path) -> Path:
    (root / "setups").mkdir(parents=True)
    (root / "fedrep").mkdir()
    (root / "setups" / "toy.toml").write_text('dataset = "digits"\nnum-clients = 2\nlr = 0.05\n')
    (root / "fedrep" / "toy.toml").write_text("lr = 0.02\nhead-epochs = 2\n")
    (root / "fedrep" / "slow.toml").write_text("lr = 0.01\n")
    return root


def test_cell_config_layers_setup_method_variant_overrides(tmp_path: Path) -> None:
    configs = _configs(tmp_path / "configs")
    out = tmp_path / "out"
    config = sweep.cell_config("fedrep:slow", "toy", 3, out, {"eval-every": 2}, "-x", configs)
    assert config["dataset"] == "digits" and config["head-epochs"] == 2  # setup + method
    assert config["lr"] == 0.01 and config["eval-every"] == 2  # variant, then overrides
    assert config["method"] == "fedrep" and config["label"] == "fedrep:slow"
    assert config["setup"] == "toy-x" and config["seed"] == 3
    assert config["run-name"] == "fedrep-slow-toy-x-s3"
    assert config["client-state-dir"] == str(out / "client-state")
    assert sweep.cell_config("local", "toy", 0, out, configs=configs)["lr"] == 0.05
    with pytest.raises(FileNotFoundError, match="setup 'nope'"):
        sweep.cell_config("fedrep", "nope", 0, out, configs=configs)
    with pytest.raises(FileNotFoundError, match="variant 'fedrep:missing'"):
        sweep.cell_config("fedrep:missing", "toy", 0, out, configs=configs)


def test_bad_cell_fails_before_any_run(tmp_path: Path, capsys) -> None:
    configs = _configs(tmp_path / "configs")
    argv = ["--methods", "fedrep", "--setups", "toy", "--seeds", "0", "--out", str(tmp_path / "o")]
    status = sweep.main([*argv, "--set", "lr=-1", "--configs", str(configs)])
    assert status == 2
    assert "'lr'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_sweep_runs_resumes_and_feeds_the_report(tmp_path: Path, cache_dir: Path, capsys) -> None:
    out = tmp_path / "sweep"
    argv = [
        "--methods",
        "local",
        "fedrep",
        "--setups",
        "digits-label-skew",
        "--seeds",
        "0",
        "--out",
        str(out),
        "--set",
        "num-server-rounds=2",
        "num-clients=2",
        f"cache-dir='{cache_dir}'",
        "pretrain-epochs=30",
        "tensorboard=true",
    ]
    assert sweep.main(argv) == 0
    cells = json.loads((out / "sweep.json").read_text())["cells"]
    assert [(c["label"], c["state"], c["state-before"]) for c in cells] == [
        ("local", "done", "new"),
        ("fedrep", "done", "new"),
    ]
    run = out / "runs" / "fedrep-digits-label-skew-s0"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]

    # TensorBoard event files hold the rounds' scalars
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("test-accuracy-mean")]
    expected = [(r["round"], r["test-accuracy-mean"]) for r in metrics]
    assert logged == [(s, pytest.approx(v)) for s, v in expected]

    # an interrupted run (summary lost, checkpoints kept) resumes; finished runs are reused
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()
    assert sweep.main(argv) == 0
    cells = json.loads((out / "sweep.json").read_text())["cells"]
    assert [c["state-before"] for c in cells] == ["done", "interrupted"]
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["final-per-client-accuracy"] == summary["final-per-client-accuracy"]

    report = tmp_path / "report"
    assert report_main([str(out), "--out", str(report)]) == 0
    table = (report / "table.md").read_text()
    assert "local (reference)" in table and "| fedrep |" in table


def test_a_cell_without_a_client_count_fails_before_any_run(tmp_path: Path, capsys) -> None:
    configs = _configs(tmp_path / "configs")
    (configs / "setups" / "toy.toml").write_text('dataset = "digits"\n')  # no num-clients
    argv = ["--methods", "local", "--setups", "toy", "--seeds", "0", "--out", str(tmp_path / "o")]
    assert sweep.main([*argv, "--configs", str(configs)]) == 2
    assert "num-clients = 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_durations_read_as_seconds_minutes_and_hours() -> None:
    assert [sweep.duration(s) for s in (0.4, 59.4, 61, 3569, 3600, 7500)] == [
        "0 s", "59 s", "1 min", "59 min", "1 h 00 min", "2 h 05 min",
    ]  # fmt: skip


def test_time_left_is_the_time_per_cell_run_times_the_cells_left() -> None:
    # One kind, one cell at a time: the old rule, wall time per cell run x cells left.
    now = [100.0]
    left = sweep.TimeLeft(cells=5, kinds={"a toy": 5}, clock=lambda: now[0])
    now[0] += 0.5
    assert left.ended("a toy", 0.5, "done") == "0 s elapsed"  # found finished: no estimate
    now[0] += 600
    assert left.ended("a toy", 600.0) == "10 min elapsed, about 30 min left"  # 600 s x 3
    now[0] += 600
    assert left.ended("a toy", 600.0) == "20 min elapsed, about 20 min left"
    now[0] += 1200
    left.ended("a toy", 1200.0)
    assert left.ended("a toy", 1.0) == "40 min elapsed"  # nothing left


def test_a_resumed_cell_counts_as_work_done_but_not_as_a_whole_cells_time() -> None:
    # After a resume the first cell to end ran its last rounds only (60 s of a 600 s cell):
    # taken as a whole cell it would say 3 x 60 s left.
    now = [0.0]
    left = sweep.TimeLeft(cells=5, kinds={"a toy": 5}, clock=lambda: now[0])
    now[0] = 60.0
    assert left.ended("a toy", 60.0, "interrupted") == "1 min elapsed"  # no whole cell yet
    now[0] = 660.0
    # 3 left x 600 s, at 660 cell s in 660 wall s: one at a time.
    assert left.ended("a toy", 600.0) == "11 min elapsed, about 30 min left"
    # Two at once: the resumed cell's 60 s ran beside the new one's 600 s in 600 wall s.
    now = [0.0]
    both = sweep.TimeLeft(cells=6, kinds={"a toy": 6}, clock=lambda: now[0])
    now[0] = 60.0
    both.ended("a toy", 60.0, "interrupted")
    now[0] = 600.0
    assert both.ended("a toy", 600.0) == "10 min elapsed, about 36 min left"  # 4 x 600 x 600 / 660
    # A resumed study knows its earlier cells' seconds: the first line estimates from them.
    now = [0.0]
    known = sweep.TimeLeft(4, {"a toy": 4}, clock=lambda: now[0], earlier={"a toy": [600.0]})
    now[0] = 60.0
    assert known.ended("a toy", 60.0, "interrupted") == "1 min elapsed, about 30 min left"


def test_time_left_weighs_each_kind_by_its_own_cells_and_the_cells_run_at_once() -> None:
    now = [0.0]
    left = sweep.TimeLeft(cells=7, kinds={"slow s": 3, "fast s": 4}, clock=lambda: now[0])
    now[0] = 1200.0
    # No fast cell has run: its 4 take the mean so far (1200 s): (2 + 4) x 1200 s.
    assert left.ended("slow s", 1200.0) == "20 min elapsed, about 2 h 00 min left"
    now[0] = 1260.0
    # Now 2 slow x 1200 s + 3 fast x 60 s = 2580 s of cells, at 1260 wall s per 1260 cell s.
    assert left.ended("fast s", 60.0) == "21 min elapsed, about 43 min left"
    # Two cells at once: 2 x 1200 cell s in 1200 wall s halve the time left.
    now = [0.0]
    both = sweep.TimeLeft(cells=6, kinds={"slow s": 6}, clock=lambda: now[0])
    now[0] = 1200.0
    both.ended("slow s", 1200.0)
    assert both.ended("slow s", 1200.0) == "20 min elapsed, about 40 min left"  # 4 x 1200 / 2
    # A cell of no declared kind, or of unknown seconds, still counts as ended.
    other = sweep.TimeLeft(cells=3, clock=lambda: now[0])
    now[0] = 1800.0
    assert other.ended("x s") == "10 min elapsed"
    assert other.ended("x s", 600.0) == "10 min elapsed, about 10 min left"  # 1 x 600 s


def test_each_cells_line_ends_with_the_time_elapsed_and_left(tmp_path: Path, capsys) -> None:
    now = [0.0]
    log = sweep.SweepLog(tmp_path, 2, sweep.TimeLeft(2, clock=lambda: now[0]))
    cells = [
        sweep.Cell("fedrep", "toy", seed, {"output-dir": "o", "run-name": f"r{seed}"})
        for seed in (0, 1)
    ]
    record = {
        "state": "done", "metric": "accuracy", "final": 0.5, "state-before": "new", "seconds": 90,
    }  # fmt: skip
    now[0] = 90.0
    log.add(cells[0], {**record, "run": "o/r0"})
    now[0] = 95.0
    log.add(cells[1], {"state": "failed", "error": "boom", "run": "o/r1", "state-before": "new"})
    out = capsys.readouterr()
    assert (
        out.out
        == "[1/2] fedrep toy seed 0: accuracy 0.5000 (new); 2 min elapsed, about 2 min left\n"
    )
    assert out.err == "FAILED fedrep toy seed 1: boom [2/2; 2 min elapsed]\n"
    written = json.loads((tmp_path / "sweep.json").read_text())["cells"]
    assert [r["run"] for r in written] == ["o/r0", "o/r1"]


def test_two_sweeps_into_one_directory_at_once_keep_each_others_records(tmp_path: Path) -> None:
    # Both logs open before either has written (two commands started together): each write
    # merges what the file holds by then, so neither drops the other's cells.
    first = sweep.SweepLog(tmp_path, 2, sweep.TimeLeft(2))
    second = sweep.SweepLog(tmp_path, 1, sweep.TimeLeft(1))
    cells = [
        sweep.Cell(label, "toy", 0, {"output-dir": "o", "run-name": label})
        for label in ("fedrep", "local")
    ]
    record = {"state": "done", "metric": "accuracy", "state-before": "new", "seconds": 1.0}
    first.add(cells[0], {**record, "run": "o/fedrep", "final": 0.5})
    second.add(cells[1], {**record, "run": "o/local", "final": 0.6})
    first.add(cells[0], {**record, "run": "o/fedrep", "final": 0.7})  # the same run again
    written = json.loads((tmp_path / "sweep.json").read_text())["cells"]
    assert {r["run"]: r["final"] for r in written} == {"o/fedrep": 0.7, "o/local": 0.6}
    assert len(written) == 2


class _CardPool(QueuePool):
    """A serial pool whose cells run no training: each writes a finished run recording the
    foundation card ``card()`` gives at the time; finished runs are not run again."""

    def __init__(self, card) -> None:  # noqa: ANN001
        super().__init__()
        self._card = card

    def finish(self, cell) -> dict:  # noqa: ANN001
        if not (cell.run_dir / "summary.json").is_file():
            self.ran.append(cell.run_dir.name)
            cell.run_dir.mkdir(parents=True)
            config = {"run-config": cell.config, "foundation": self._card()}
            (cell.run_dir / "config.json").write_text(json.dumps(config))
            (cell.run_dir / "summary.json").write_text("{}")
        record = {"state": "done", "metric": "accuracy", "final": 0.5, "seconds": 1.0}
        return {**record, "run": str(cell.run_dir), "state-before": "new"}


def test_a_sweep_stops_at_a_run_on_another_foundation_model_and_refuses_to_go_on_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Runs of one setup and seed pair across methods, so they share one model: a run that
    ends on another build stops the sweep (exit 1), the next sweep refuses before any run
    (exit 2), and once that run is moved away it runs again on the first build."""
    import shutil

    from fedfm_flower.models.foundation_cards import WEIGHTS_SHA256

    first = {"key": "abc", WEIGHTS_SHA256: "1" * 64}
    now = [first]
    pools: list[_CardPool] = []

    def pool(args) -> _CardPool:  # noqa: ANN001
        pools.append(_CardPool(lambda: now[0]))
        return pools[-1]

    monkeypatch.setattr(sweep, "pool_from_arguments", pool)
    out, configs = tmp_path / "out", _configs(tmp_path / "configs")
    argv = ["--methods", "fedrep", "local", "--setups", "toy", "--seeds", "0", "--out", str(out)]
    argv += ["--configs", str(configs)]
    assert sweep.main(argv) == 0 and pools[0].ran == ["fedrep-toy-s0", "local-toy-s0"]
    shutil.rmtree(out / "runs" / "local-toy-s0")
    now[0] = {"key": "abc", WEIGHTS_SHA256: "2" * 64}  # another machine's build in the cache
    capsys.readouterr()
    assert sweep.main(argv) == 1 and pools[1].ran == ["local-toy-s0"]
    said = capsys.readouterr().err
    assert "two builds of foundation abc" in said and "local-toy-s0" in said
    assert sweep.main(argv) == 2 and len(pools) == 2  # refused before a pool was made
    assert "fedrep-toy-s0" in capsys.readouterr().err
    shutil.rmtree(out / "runs" / "local-toy-s0")
    now[0] = first
    assert sweep.main(argv) == 0 and pools[2].ran == ["local-toy-s0"]


def test_a_run_names_seed_and_a_study_names_parts_are_read_back() -> None:
    from fedfm_flower.study.sweep import run_name, seed_of_run
    from fedfm_flower.study.tune import study_name, study_parts

    for label, setup, tag, seed in (("fedavg", "toy", "", 0), ("fedvpt:deep", "glyphs", "-x", 12)):
        name = run_name(label, setup, tag, seed)
        assert seed_of_run(name, label, setup, tag) == seed
        assert seed_of_run(name, label, setup + tag, "") == seed  # a study's setup has its tag
        assert study_parts(study_name(label, setup, tag)) == (label, setup + tag)
    assert seed_of_run("fedavg-vanilla-toy-s0", "fedavg", "toy", "") is None  # a variant's run
    assert seed_of_run("fedavg-toy-s", "fedavg", "toy", "") is None
    assert seed_of_run("fedavg-toy-s1x", "fedavg", "toy", "") is None
    assert seed_of_run("local-toy-s1", "fedavg", "toy", "") is None
