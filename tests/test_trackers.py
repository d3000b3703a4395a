"""Trackers: W&B (offline) and MLflow (file store) runs hold what metrics.jsonl and the summary
hold; a tracker that fails mid-run is switched off and the run goes on."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from fedfm_flower.records.trackers.base import round_scalars
from fedfm_flower.records.trackers.run import Trackers, open_trackers

WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-style log of 32 KiB blocks


def wandb_records(path: Path) -> list[tuple[str, Any]]:
    """(record type, record) of every record in an offline W&B run's ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, chunks, partial = 7, [], b""
    while position + 7 <= len(data):
        left = WANDB_BLOCK - position % WANDB_BLOCK
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:  # padding to the end of a block
            position += left
            continue
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 1:  # a whole record
            chunks.append(chunk)
        elif kind == 2:  # first part
            partial = chunk
        elif kind == 3:  # middle part
            partial += chunk
        elif kind == 4:  # last part
            chunks.append(partial + chunk)
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        kind = record.WhichOneof("record_type")
        records.append((kind, getattr(record, kind) if kind else None))
    return records


def items(updates: Any) -> dict[str, Any]:
    return {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates}


def test_wandb_mlflow_and_tensorboard_runs_hold_the_records(
    small_run_config: dict, tmp_path: Path, monkeypatch
) -> None:
    from mlflow.tracking import MlflowClient

    from server_apps.inprocess import run_in_process

    monkeypatch.setenv("WANDB_SILENT", "true")
    output = Path(small_run_config["output-dir"])
    config = {
        **small_run_config,
        "method": "fedavg",
        "run-name": "tracked",
        "tensorboard": True,
        "wandb": True,
        "wandb-mode": "offline",
        "wandb-project": "fedfm-test",
        "mlflow": True,
        "mlflow-experiment": "fedfm-test",
    }
    summary, _ = run_in_process(config, num_nodes=4)
    run_dir = output / "tracked"
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert len(rounds) == 2
    expected = {r["round"]: round_scalars(r) for r in rounds}
    assert "test-accuracy-mean" in expected[2] and "train-loss-mean" in expected[1]

    # W&B, offline: config, one history row per round at step = round, the summary
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = wandb_records(wandb_file)
    config_seen: dict[str, Any] = {}
    history = {}
    summary_seen: dict[str, Any] = {}
    for kind, record in records:
        if kind == "run":  # the run's first record carries the config
            config_seen.update(items(record.config.update))
        elif kind == "config":
            config_seen.update(items(record.update))
        elif kind == "history":
            row = items(record.item)
            history[row["_step"]] = row
        elif kind == "summary":
            summary_seen.update(items(record.update))
    assert config_seen["method"] == "fedavg" and config_seen["num-server-rounds"] == 2
    assert sorted(history) == [1, 2]
    for step, values in expected.items():
        for key, value in values.items():
            assert history[step][key] == pytest.approx(value), (step, key)
    assert summary_seen["final-test-accuracy-mean"] == pytest.approx(
        summary["final-test-accuracy-mean"]
    )
    assert summary_seen["run-name"] == "tracked"

    # MLflow, a local store in the output directory: params, metrics per step, the summary
    client = MlflowClient(tracking_uri=f"sqlite:///{output.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fedfm-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params["method"] == "fedavg" and run.data.params["num-server-rounds"] == "2"
    for key in ("test-accuracy-mean", "train-loss-mean", "bytes-up"):
        logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert logged == {step: pytest.approx(values[key]) for step, values in expected.items()}
    assert run.data.metrics["summary-final-test-accuracy-mean"] == pytest.approx(
        summary["final-test-accuracy-mean"]
    )
    # its artifacts beside the store, not under the directory the run started in (./mlruns)
    stored = json.loads(next((output / "mlartifacts").rglob("summary.json")).read_text())
    assert stored["run-name"] == "tracked"
    assert not (Path.cwd() / "mlruns").exists()

    # TensorBoard: the summary's scalars beside the rounds'
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    (final,) = events.Scalars("summary/final-test-accuracy-mean")
    assert (final.step, final.value) == (2, pytest.approx(summary["final-test-accuracy-mean"]))


class Recorder:
    def __init__(self, fail_on: str = "") -> None:
        self.calls: list[str] = []
        self.fail_on = fail_on

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail_on:
            raise ConnectionError("the tracking server went away")

    def log_round(self, record: dict) -> None:
        self._call("log_round")

    def log_summary(self, summary: dict) -> None:
        self._call("log_summary")

    def close(self, failed: bool) -> None:
        self._call(f"close failed={failed}")


def test_a_tracker_that_fails_mid_run_is_switched_off_and_the_others_go_on(caplog) -> None:
    broken, working = Recorder(fail_on="log_round"), Recorder()
    trackers = Trackers({"broken": broken, "working": working})
    with caplog.at_level("WARNING"):
        trackers.log_round({"round": 1})
        trackers.log_round({"round": 2})
        trackers.log_summary({})
        trackers.close(failed=False)
    assert broken.calls == ["log_round"]
    assert working.calls == ["log_round", "log_round", "log_summary", "close failed=False"]
    assert "tracker broken failed (ConnectionError" in caplog.text


def test_a_missing_tracker_package_fails_at_start_naming_the_key(monkeypatch, tmp_path) -> None:
    import importlib.util

    from fedfm_flower.config.experiment import ExperimentConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    config = ExperimentConfig().replace(mlflow=True)
    with pytest.raises(ImportError, match=r"'mlflow' = true needs the mlflow package"):
        open_trackers(config, tmp_path, "run")


def test_bad_tracker_settings_name_the_key() -> None:
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.methods.settings import ConfigError

    with pytest.raises(ConfigError, match="'wandb-mode'"):
        ExperimentConfig.from_run_config({"wandb-mode": "cloud"})
    with pytest.raises(ConfigError, match="'wandb-project'"):
        ExperimentConfig.from_run_config({"wandb": True, "wandb-project": ""})


def test_a_tracker_that_cannot_start_closes_the_ones_already_open(monkeypatch, tmp_path) -> None:
    import fedfm_flower.records.trackers.run as run_module
    from fedfm_flower.config.experiment import ExperimentConfig

    board = Recorder()

    def no_login(*args: Any) -> None:
        raise PermissionError("wandb: not logged in")

    monkeypatch.setattr(run_module, "TensorBoardLog", lambda path: board)
    monkeypatch.setattr(run_module, "WandbLog", no_login)
    config = ExperimentConfig().replace(tensorboard=True, wandb=True)
    with pytest.raises(PermissionError, match="not logged in"):
        open_trackers(config, tmp_path, "run")
    assert board.calls == ["close failed=True"]
