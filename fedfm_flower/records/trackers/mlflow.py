"""MLflow (run-config ``mlflow = true``): one MLflow run per fedfm-flower run.

Tracking URI ``mlflow-tracking-uri``, or when empty a local SQLite store
``<output-dir>/mlflow.db`` (``mlflow ui --backend-store-uri sqlite:///runs/mlflow.db``; MLflow 3
refuses its older ``./mlruns`` file store by default, and SQLite is the local store it
recommends), its artifacts under ``<output-dir>/mlartifacts``; experiment
``mlflow-experiment``. The MLflow run is tagged with the run directory's path, so
``resume = true`` continues the same MLflow run. The run config becomes the run's parameters,
each round's numeric values metrics at step = round, the summary's numeric values metrics
``summary-<key>`` and the whole summary the artifact ``summary.json``.

Imports inside functions keep ``mlflow`` out of this module's start-up.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfm_flower.records.trackers.base import round_scalars

if TYPE_CHECKING:
    from fedfm_flower.config.experiment import ExperimentConfig

RUN_TAG = "fedfm-flower.run-dir"
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a parameter's value


def tracking_uri(config: ExperimentConfig) -> str:
    """``mlflow-tracking-uri``, or a SQLite store in the output directory."""
    if config.mlflow_tracking_uri:
        return config.mlflow_tracking_uri
    return f"sqlite:///{Path(config.output_dir).resolve() / 'mlflow.db'}"


def artifact_location(config: ExperimentConfig) -> str | None:
    """Where a new experiment of the default store keeps its artifacts: ``<output-dir>/mlartifacts``
    (MLflow's own default, ``./mlruns``, is relative to whatever directory the run started in);
    None (MLflow's choice) for a tracking URI of the user's."""
    if config.mlflow_tracking_uri:
        return None
    return (Path(config.output_dir).resolve() / "mlartifacts").as_uri()


class MlflowLog:
    """Logs one run to MLflow."""

    def __init__(self, config: ExperimentConfig, run_path: Path, run_name: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri(config))
        experiment = self.client.get_experiment_by_name(config.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(
                config.mlflow_experiment, artifact_location=artifact_location(config)
            )
        )
        directory = str(run_path.resolve())
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{directory}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
        else:
            run = self.client.create_run(
                experiment_id, run_name=run_name, tags={RUN_TAG: directory}
            )
            self.run_id = run.info.run_id
            params = [
                Param(key, str(value)[:MAX_PARAM_LENGTH])
                for key, value in sorted(config.to_run_config().items())
            ]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 per batch
                self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.last_round = 0

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(key, value, stamp, step) for key, value in values.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def log_round(self, record: dict[str, Any]) -> None:
        """The record's numeric values as metrics at step = round."""
        self.last_round = int(record["round"])
        self._metrics(round_scalars(record), self.last_round)

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The summary's numeric values as ``summary-<key>`` metrics and as ``summary.json``."""
        self._metrics(
            {f"summary-{k}": v for k, v in round_scalars(summary).items()}, self.last_round
        )
        self.client.log_dict(self.run_id, summary, "summary.json")

    def close(self, failed: bool) -> None:
        """End the MLflow run as FINISHED, or FAILED."""
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
