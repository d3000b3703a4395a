"""One run on the deployment: its run config (merged, checked, written as TOML) and its outcome.

``LocalDeployment.start_run`` submits ``flwr run <app> fedfm-local --stream --run-config
<workdir>/run-config.toml``; ``LocalDeployment.finish_run`` waits for it and returns a
``RunResult`` (Flower's final status, the results directory, the launcher's exit status).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomli_w

from fedfm_flower.simulation.preflight import (
    PreflightError,
    absolute_paths,
    parse_item,
    resolve_config,
)
from fedfm_flower.simulation.verdict import COMPLETED_STATUS, ExitCode, exit_code_for_status


class RunConfigError(ValueError):
    """An invalid --run-config value."""


@dataclasses.dataclass
class RunResult:
    """What one `flwr run` produced."""

    run_id: int | None
    status: str  # e.g. "finished:completed", "finished:failed", "not-started", "timeout"
    returncode: int | None
    seconds: float
    run_dir: Path | None
    log_path: Path
    details: str = ""  # Flower's status details (the ServerApp's error, when it failed)

    @property
    def ok(self) -> bool:
        """True when Flower reports the run as completed."""
        return self.status == COMPLETED_STATUS

    @property
    def exit_code(self) -> ExitCode:
        """The launcher's exit status for this outcome."""
        if self.status == "timeout":
            return ExitCode.TIMEOUT
        if self.status == "not-started":
            return ExitCode.NOT_STARTED
        return exit_code_for_status(self.status)


def parse_run_config(items: Sequence[str] | None) -> dict[str, Any]:
    """Merge --run-config items (TOML files or "k=v ..." strings, in order) into one dict.

    Uses Flower's own parser for each item, so values follow `flwr run`'s rules (strings need
    quotes: ``method='fedavg'``).
    """
    merged: dict[str, Any] = {}
    for item in items or []:
        if item.strip():
            try:
                merged.update(parse_item(item, Path.cwd()))
            except PreflightError as err:
                raise RunConfigError(str(err)) from err
    return merged


def resolve_run_config(
    overrides: Mapping[str, Any], num_clients: int, app_dir: Path, base: Path | None = None
) -> dict[str, Any]:
    """Overrides plus ``num-clients``, absolute paths and a default ``output-dir``.

    Paths are made absolute against ``base`` (the caller's directory), since the ServerApp and
    ClientApps run with the SuperLink's and SuperNodes' working directories. Keys must exist
    under ``[tool.flwr.app.config]`` of the app (Flower rejects others) and values must pass
    ``ExperimentConfig`` validation; both are checked here, before anything starts.
    """
    config = dict(overrides)
    given = config.get("num-clients")
    if given not in (None, 0, num_clients):
        raise RunConfigError(
            f"run config num-clients={given} differs from --num-supernodes {num_clients}"
        )
    config["num-clients"] = num_clients
    config.setdefault("output-dir", str(app_dir / "runs"))
    config = absolute_paths(config, base or Path.cwd())
    try:  # every value, not just the keys: fail here rather than in the ServerApp
        resolve_config(app_dir, config)
    except PreflightError as err:
        raise RunConfigError(str(err)) from err
    return config


def write_toml(path: Path, data: Mapping[str, Any]) -> Path:
    """Write a flat or nested mapping as TOML."""

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(dict(data)))
    return path


def run_dir_from_lines(lines: Sequence[str]) -> Path | None:
    """The results directory a run's output names last (``results in <dir>``), if any."""
    for line in reversed(lines):
        match = re.search(r"results in (\S+)", line)
        if match:
            return Path(match.group(1).rstrip(";,"))
    return None
