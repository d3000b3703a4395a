"""Reading finished run directories into ``RunResult`` values, the input of every report.

A run directory (``fedfm_flower.records.results``) is recognised by its ``config.json`` and
``metrics.jsonl``; only runs with a ``summary.json`` (finished) are reported, the others are
listed as skipped. A run's method label is its ``label`` config key (``method:variant`` in
sweeps), else its method; its setup is the ``setup`` key, else its dataset. Per-client values
are keyed by the stable client id carried in every reply (never the node id, which changes
between runs), so two runs of one seed pair client by client. Its data seed is the one its data
came from (``data-seed``, or its seed where that is -1: ``grid_foundations.run_data_seed``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfm_flower.records import protocol as P
from fedfm_flower.study.grid_foundations import run_data_seed


@dataclass(frozen=True)
class RunResult:
    """What a report needs from one finished run."""

    path: Path
    label: str  # method or method:variant
    setup: str
    seed: int
    metric: str  # the reported metric: the task's primary one (e.g. "accuracy") unless chosen
    rounds: tuple[int, ...]  # the evaluated rounds
    curve: tuple[float, ...]  # mean over clients of the metric at each evaluated round
    final: dict[int, float]  # client id -> metric at the last evaluated round
    bytes_down: tuple[int, ...]  # per round, all clients
    bytes_up: tuple[int, ...]
    clients_reported: tuple[int, ...]  # per round
    final_metrics: dict[int, dict[str, float]]  # client id -> every reply metric, last evaluation
    foundation: dict[str, Any] = field(default_factory=dict)  # config.json's card ({}: none)
    data_seed: int | None = None  # the seed its data came from (run_data_seed); None: not read

    @property
    def final_mean(self) -> float:
        """Mean over clients of the final metric (the run's headline number)."""
        return sum(self.final.values()) / len(self.final) if self.final else math.nan


def find_runs(paths: Iterable[Path]) -> list[Path]:
    """Run directories at or below ``paths`` (a path may be a run or a folder of runs)."""
    found: set[Path] = set()
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"no such run directory or folder: {path}")
        candidates = [path] if (path / "config.json").is_file() else []
        candidates += [p.parent for p in path.rglob("config.json")]
        found.update(p.resolve() for p in candidates if (p / "metrics.jsonl").is_file())
    return sorted(found)


def read_run(path: Path, metric: str = "") -> RunResult | None:
    """The finished run at ``path`` reported on ``metric`` (default: its primary metric); None
    when it has no ``summary.json`` yet."""
    if not (path / "summary.json").is_file():
        return None
    try:
        payload = json.loads((path / "config.json").read_text())
        config = payload["run-config"]
        summary = json.loads((path / "summary.json").read_text())
        records = [json.loads(line) for line in (path / "metrics.jsonl").open() if line.strip()]
    except (OSError, KeyError, ValueError) as err:
        raise ValueError(f"run directory {path} is not readable: {err}") from err
    metric = metric or summary.get("primary-metric", "accuracy")
    key = P.test_metric(metric)
    evaluated = [r for r in records if r.get("evaluate")]
    if evaluated and any(key not in m for m in evaluated[-1]["evaluate"].values()):
        known = sorted(k for k in next(iter(evaluated[-1]["evaluate"].values())) if k != key)
        raise ValueError(f"run {path} has no metric '{metric}' ({key}); its reply keys: {known}")
    final, final_metrics = {}, {}
    if evaluated:
        final = {int(m[P.CLIENT_ID]): float(m[key]) for m in evaluated[-1]["evaluate"].values()}
        final_metrics = {
            int(m[P.CLIENT_ID]): {k: float(v) for k, v in m.items() if isinstance(v, int | float)}
            for m in evaluated[-1]["evaluate"].values()
        }
    return RunResult(
        path=path,
        label=config.get("label") or config["method"],
        setup=config.get("setup") or config["dataset"],
        seed=int(config["seed"]),
        metric=metric,
        rounds=tuple(int(r["round"]) for r in evaluated),
        curve=tuple(_client_mean(r, key) for r in evaluated),
        final=final,
        bytes_down=tuple(int(r["bytes-down"]) for r in records),
        bytes_up=tuple(int(r["bytes-up"]) for r in records),
        clients_reported=tuple(int(r["clients-reported"]) for r in records),
        final_metrics=final_metrics,
        foundation=dict(payload.get("foundation") or {}),
        data_seed=run_data_seed(config),
    )


def _client_mean(record: dict[str, Any], key: str) -> float:
    values = [float(m[key]) for m in record["evaluate"].values()]
    return sum(values) / len(values)


def is_validation_run(path: Path) -> bool:
    """Whether the run at ``path`` evaluated on its validation split (a tuning trial), whose
    ``test-*`` values are validation values and never belong in a results table."""
    try:
        config = json.loads((path / "config.json").read_text())["run-config"]
    except (OSError, KeyError, ValueError):
        return False
    return config.get("evaluation-split", "test") == "val"


def load_runs(paths: Iterable[Path], metric: str = "") -> tuple[list[RunResult], list[Path]]:
    """(finished runs, run directories not reported) at or below ``paths``, reported on
    ``metric`` (default: each run's primary metric): a run not finished, or whose final
    per-client values are not all finite (it diverged), is not reported; validation runs
    (``is_validation_run``) are left out."""
    finished, unfinished = [], []
    for path in find_runs(paths):
        if is_validation_run(path):
            continue
        run = read_run(path, metric)
        finite = run is not None and all(math.isfinite(v) for v in run.final.values())
        (finished if finite else unfinished).append(run if finite else path)
    return finished, unfinished
