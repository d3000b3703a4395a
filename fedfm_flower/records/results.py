"""The run directory: resolved config, per-round metrics, checkpoints and the final summary.

Layout of ``<output-dir>/<run-name>/``::

    config.json          the resolved run config (kebab-case keys) and the foundation card
    metrics.jsonl        one JSON object per round (see ``RoundRecord``)
    checkpoints/         round_00005.safetensors + round_00005.json (server state)
    summary.json         final and best mean accuracy, totals, times

Everything is plain JSON or safetensors (never pickle), so results can be read and plotted
without this package.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.models.foundation_cards import recorded_card
from fedfm_flower.records.durable import (
    DamagedFileError,
    atomic_write_text,
    load_tensors,
    read_sealed_json,
    save_tensors,
    sealed_json,
)

if TYPE_CHECKING:
    import torch

_CHECKPOINT = re.compile(r"^round_(\d{5,})\.json$")
# A checkpoint record's seal (durable.sealed_json), and the keys records had before it.
RECORD_SEAL = "record-sha256"
UNSEALED_RECORD_KEYS = frozenset({"round", "sha256", "strategy", "evaluation-pending"})
FAILURE_FILE = "failure.json"
CLIENT_PARTITIONS = "client-partitions"  # summary.json: {client id: its node's partition}

log = logging.getLogger(__name__)


def default_run_name(config: ExperimentConfig) -> str:
    """``<method>-<dataset>-s<seed>-<UTC timestamp>``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{config.method}-{config.dataset}-s{config.seed}-{stamp}"


_WALL_CLOCK = re.compile("seconds|time|started|finished")


class RunDirectory:
    """Reads and writes one run's results."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.metrics_path = path / "metrics.jsonl"
        self.checkpoint_dir = path / "checkpoints"

    @classmethod
    def open(cls, config: ExperimentConfig) -> RunDirectory:
        """Create the directory for a new run, or open it for ``resume``; never overwrite."""
        name = config.run_name or default_run_name(config)
        path = Path(config.output_dir).expanduser().resolve() / name
        run = cls(path)
        if config.resume:
            if not path.is_dir():
                raise FileNotFoundError(f"resume=true but run directory {path} does not exist")
        elif run.metrics_path.exists() and run.metrics_path.stat().st_size > 0:
            raise FileExistsError(
                f"run directory {path} already holds results; set resume=true to continue it "
                "or choose another run-name"
            )
        run.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        return run

    @property
    def name(self) -> str:
        """The run name (directory name)."""
        return self.path.name

    def write_config(self, config: ExperimentConfig, extra: dict[str, Any]) -> None:
        """Save the resolved config and extra facts (foundation card, nodes, versions)."""
        payload = {"run-config": config.to_run_config(), **extra}
        atomic_write_text(self.path / "config.json", json.dumps(payload, indent=2))

    def recorded_foundation(self) -> dict[str, Any]:
        """The foundation card ``config.json`` records ({} when there is none to read)."""
        return recorded_card(self.path)[0]

    def append_round(self, record: dict[str, Any]) -> None:
        """Append one round's record to metrics.jsonl (flushed and fsynced)."""
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def rounds(self) -> list[dict[str, Any]]:
        """All round records written so far."""
        if not self.metrics_path.exists():
            return []
        with open(self.metrics_path) as handle:
            return [json.loads(line) for line in handle if line.strip()]

    def rounds_without_times(self) -> list[dict[str, Any]]:
        """The round records without their wall-clock values (keys naming seconds, times,
        starts or ends, at any depth): what two runs of the same work must share bit for bit."""

        def strip(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: strip(v) for k, v in value.items() if not _WALL_CLOCK.search(k)}
            return value

        return [strip(record) for record in self.rounds()]

    def replace_round(self, record: dict[str, Any]) -> None:
        """Rewrite metrics.jsonl atomically with ``record`` in place of the record of its round
        (a fused round's evaluation arrives with the next round's replies)."""
        kept = [record if r["round"] == record["round"] else r for r in self.rounds()]
        atomic_write_text(
            self.metrics_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept)
        )

    def truncate_rounds(self, last_round: int) -> None:
        """Drop records of rounds after ``last_round`` (used when resuming)."""
        kept = [r for r in self.rounds() if r["round"] <= last_round]
        atomic_write_text(
            self.metrics_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept)
        )

    def save_checkpoint(
        self, server_round: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any], keep: int
    ) -> None:
        """Write the server state after ``server_round``; the JSON file (with the tensors' digest,
        sealed with its own) commits it, and only then are checkpoints older than the newest
        ``keep`` removed."""
        stem = self.checkpoint_dir / f"round_{server_round:05d}"
        digest = save_tensors(stem.with_suffix(".safetensors"), tensors)
        record = {"round": server_round, "sha256": digest, **meta}
        atomic_write_text(stem.with_suffix(".json"), sealed_json(record, RECORD_SEAL))
        for old in self.checkpoint_rounds()[:-keep]:
            old_stem = self.checkpoint_dir / f"round_{old:05d}"
            old_stem.with_suffix(".json").unlink(missing_ok=True)
            old_stem.with_suffix(".safetensors").unlink(missing_ok=True)

    def checkpoint_rounds(self) -> list[int]:
        """Rounds with a committed checkpoint (a JSON marker), oldest first."""
        if not self.checkpoint_dir.is_dir():
            return []
        return sorted(
            int(m.group(1))
            for p in self.checkpoint_dir.iterdir()
            if (m := _CHECKPOINT.match(p.name))
        )

    def load_checkpoint(self, server_round: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Tensors and metadata of the checkpoint after ``server_round``: the JSON record checked
        against its seal, the tensors against the digest in it; ``DamagedFileError`` names the
        file that is not intact."""
        stem = self.checkpoint_dir / f"round_{server_round:05d}"
        marker = stem.with_suffix(".json")
        try:
            meta = read_sealed_json(marker, RECORD_SEAL, UNSEALED_RECORD_KEYS)
        except DamagedFileError as err:
            raise DamagedFileError(marker, f"unreadable checkpoint record: {err.reason}") from err
        if meta.get("round") != server_round:
            raise DamagedFileError(marker, f"not the record of round {server_round}")
        return load_tensors(stem.with_suffix(".safetensors"), meta.get("sha256"), own=True), meta

    def load_newest_checkpoint(
        self, on_damaged: Callable[[int, DamagedFileError], None] | None = None
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]] | None:
        """The newest intact checkpoint as (round, tensors, meta); None when there is none.

        A damaged checkpoint is skipped and reported to ``on_damaged`` (default: a warning that
        names the bad file); when every checkpoint is damaged, ``DamagedFileError`` lists them.
        """
        damaged: list[DamagedFileError] = []
        for server_round in reversed(self.checkpoint_rounds()):
            try:
                tensors, meta = self.load_checkpoint(server_round)
            except DamagedFileError as err:
                (on_damaged or _warn_damaged)(server_round, err)
                damaged.append(err)
                continue
            return server_round, tensors, meta
        if damaged:
            raise DamagedFileError(
                self.checkpoint_dir,
                "no intact checkpoint: " + "; ".join(str(err) for err in damaged),
            )
        return None

    def write_failure(self, failure: dict[str, Any]) -> None:
        """Record why the run stopped (``failure.json``); a later resume removes it."""
        atomic_write_text(self.path / FAILURE_FILE, json.dumps(failure, indent=2))

    def clear_failure(self) -> None:
        """Remove the record of an earlier failure (the run is being resumed)."""
        (self.path / FAILURE_FILE).unlink(missing_ok=True)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write summary.json."""
        atomic_write_text(self.path / "summary.json", json.dumps(summary, indent=2))


def _warn_damaged(server_round: int, err: DamagedFileError) -> None:
    log.warning("checkpoint of round %d is damaged (%s); trying an older one", server_round, err)


def human_bytes(count: float) -> str:
    """1536 -> '1.5 KB' (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1024 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"


PROGRESS_ABBREVIATIONS = {"accuracy": "acc"}


def progress_line(
    record: dict[str, Any],
    num_rounds: int,
    eta_s: float,
    metric: str = "accuracy",
    evaluation: dict[str, Any] | None = None,
) -> str:
    """The one-line progress report printed after each round, with the task's primary metric.

    ``evaluation`` is the record whose metric is shown (default ``record``); one of an earlier
    round (a fused round's evaluation arrives with the next round) is labelled ``acc@<round>``.
    """
    evaluation = record if evaluation is None else evaluation
    value = evaluation.get(f"test-{metric}-mean")
    label = PROGRESS_ABBREVIATIONS.get(metric, metric)
    if evaluation.get("round") != record.get("round"):
        label = f"{label}@{evaluation.get('round')}"
    value_text = (
        f"{label} {value:.4f} ± {evaluation[f'test-{metric}-std']:.4f}"
        if value is not None and not math.isnan(value)
        else f"{label}    n/a       "
    )
    phase = " post-training" if record.get("phase") == "post-training" else ""
    return (
        f"[round {record['round']:>3}/{num_rounds}{phase}] {value_text} | "
        f"train-loss {record.get('train-loss-mean', float('nan')):.4f} | "
        f"clients {record['clients-reported']}/{record['clients-sampled']} | "
        f"down {human_bytes(record['bytes-down'])} up {human_bytes(record['bytes-up'])} | "
        f"{record['round-seconds']:.1f}s | ETA {eta_s:.0f}s"
    )
