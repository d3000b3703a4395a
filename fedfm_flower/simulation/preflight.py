"""Checks of a run before anything starts: run config, resume target, files, partitions.

Both launchers (``fedfm_flower.simulation.launcher`` and ``fedfm_flower.deploy``) merge the app's
declared defaults with the user's overrides exactly as ``flwr run`` will, validate the result,
and check what would otherwise fail only after the SuperLink, Ray or the SuperNodes have
started: the run directory to resume (and its newest intact checkpoint), an existing run that
must not be overwritten, the weights file, the output directory, the number of clients and
each client's partition size. Every failure is a ``PreflightError`` with a one-line message.
The ServerApp repeats the checks that matter for plain ``flwr run`` (config validation,
partition sizes, the run directory).

Relative paths in the run config are taken relative to the app directory, where the launchers
run ``flwr run`` and hence where the ServerApp resolves them.

Imports inside functions keep ``flwr.common``, ``numpy`` and ``torch`` out of this module's
start-up.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfm_flower.config.experiment import ConfigError, ExperimentConfig
from fedfm_flower.data import DataUnavailableError, check_client_sizes
from fedfm_flower.records.durable import DamagedFileError, check_tensor_file
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.tasks import task_of

# Run-config keys that hold paths.
PATH_KEYS = (
    "output-dir",
    "cache-dir",
    "data-dir",
    "unseen-test-dir",
    "weights-file",
    "client-state-dir",
    "perada-aux-dir",
)


class PreflightError(ValueError):
    """A run that must not start; the message says what is wrong and what to change."""


@dataclass
class Preflight:
    """What the checks found: the validated config and notes for the user."""

    config: ExperimentConfig
    notes: list[str] = field(default_factory=list)


def app_defaults(app_dir: Path) -> dict[str, Any]:
    """The run config's declared keys and defaults: ``[tool.flwr.app.config]`` of the app."""
    pyproject = Path(app_dir) / "pyproject.toml"
    try:
        data = tomllib.loads(pyproject.read_text())
        return dict(data["tool"]["flwr"]["app"]["config"])
    except (OSError, KeyError, tomllib.TOMLDecodeError) as err:
        raise PreflightError(f"{pyproject}: no readable [tool.flwr.app.config] ({err})") from err


def parse_item(item: str, base_dir: Path) -> dict[str, Any]:
    """One run-config override as ``flwr run -c`` reads it: a TOML file or "k=v ..." pairs.

    A relative TOML path is taken relative to ``base_dir``.
    """
    from flwr.common.config import parse_config_args

    item = item.strip()
    if item.endswith(".toml"):
        path = Path(item).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise PreflightError(f"--run-config file not found: {path}")
        try:
            return parse_config_args([str(path)])
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise PreflightError(f"--run-config file {path} is not valid TOML: {err}") from err
    try:
        parsed = parse_config_args([item])
    except Exception as err:  # click.ClickException carries the explanation
        raise PreflightError(f"cannot parse --run-config {item!r}: {err}") from err
    if not parsed:
        raise PreflightError(f"--run-config {item!r} has no key=value pair")
    return parsed


def parse_overrides(items: Sequence[str], base_dir: Path) -> dict[str, Any]:
    """Merge ``flwr run``'s run-config overrides: one TOML file, or any number of "k=v" items."""
    items = [item.strip() for item in items if item.strip()]
    files = [item for item in items if item.endswith(".toml")]
    if files and len(items) > 1:
        raise PreflightError(
            f"--run-config: a TOML file ({files[0]}) cannot be combined with other overrides"
        )
    merged: dict[str, Any] = {}
    for item in items:
        merged.update(parse_item(item, base_dir))
    return merged


def absolute_paths(run_config: Mapping[str, Any], base_dir: Path) -> dict[str, Any]:
    """``run_config`` with the relative values of ``PATH_KEYS`` made absolute under base_dir."""
    resolved = dict(run_config)
    for key in PATH_KEYS:
        value = resolved.get(key)
        if not isinstance(value, str) or not value or "\x00" in value:
            continue  # not a path: the config's check names the key
        if not Path(value).expanduser().is_absolute():
            resolved[key] = str((base_dir / value).resolve())
    return resolved


def resolve_config(app_dir: Path, overrides: Mapping[str, Any]) -> ExperimentConfig:
    """The validated config ``flwr run`` would give the ServerApp (paths made absolute)."""
    defaults = app_defaults(app_dir)
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise PreflightError(
            f"unknown run-config key(s) {', '.join(unknown)}; declared keys are in "
            f"[tool.flwr.app.config] of {Path(app_dir) / 'pyproject.toml'}"
        )
    merged = absolute_paths({**defaults, **overrides}, Path(app_dir))
    try:
        return ExperimentConfig.from_run_config(merged)
    except ConfigError as err:
        raise PreflightError(str(err)) from err


def check_run(config: ExperimentConfig, num_nodes: int) -> Preflight:
    """Everything about ``config`` that can be checked before a federation of ``num_nodes``
    starts; ``PreflightError`` names the first problem."""
    found = Preflight(config)
    if config.num_clients not in (0, num_nodes):
        raise PreflightError(
            f"run config num-clients = {config.num_clients} but the federation has {num_nodes} "
            "SuperNodes; set them equal (or num-clients = 0 to use every node)"
        )
    _check_output(config, found)
    if config.weights_file:
        _check_weights(Path(config.weights_file).expanduser())
    _check_partitions(config, num_nodes, found)
    return found


def _check_output(config: ExperimentConfig, found: Preflight) -> None:
    """The output directory is writable; the run directory exists for resume, else is unused."""

    output = Path(config.output_dir).expanduser()
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PreflightError(f"output-dir {output} cannot be created: {err}") from err
    if not os.access(output, os.W_OK):
        raise PreflightError(f"output-dir {output} is not writable")
    if not config.run_name:
        return
    run = RunDirectory(output / config.run_name)
    if config.resume:
        if not run.path.is_dir():
            existing = sorted(p.name for p in output.iterdir() if (p / "metrics.jsonl").exists())
            hint = f" (runs there: {', '.join(existing[-5:])})" if existing else ""
            raise PreflightError(f"resume=true but run directory {run.path} does not exist{hint}")

        def note(server_round: int, err: DamagedFileError) -> None:
            found.notes.append(f"warning: checkpoint of round {server_round} is damaged: {err}")

        try:
            newest = run.load_newest_checkpoint(on_damaged=note)
        except DamagedFileError as err:
            message = f"resume=true but no checkpoint of {run.path} is intact ({err.reason})"
            raise PreflightError(message) from err
        if config.dp != "none":
            _check_privacy_ledgers(run.path, None if newest is None else newest[2], config.dp)
        found.notes.append(
            f"resuming {run.name} after round {newest[0]}"
            if newest is not None
            else f"resume=true but {run.name} has no checkpoint: it starts at round 1"
        )
    elif run.metrics_path.exists() and run.metrics_path.stat().st_size > 0:
        raise PreflightError(
            f"run directory {run.path} already holds results; set resume=true to continue it "
            "or choose another run-name"
        )


def _check_privacy_ledgers(run_path: Path, meta: dict[str, Any] | None, mode: str) -> None:
    """A DP run resumes only from a checkpoint whose ledger records fresh noise, with a
    readable ``privacy.json`` beside it (``fedfm_flower.privacy.ledger``)."""
    from fedfm_flower.privacy.ledger import LedgerFile, ReleaseLedger

    try:
        if meta is not None:
            source = f"checkpoint of round {meta.get('round')}"
            ReleaseLedger.from_json(meta.get("strategy", {}).get("privacy"), mode, source)
        LedgerFile(run_path).read(mode)
    except (ValueError, DamagedFileError) as err:
        raise PreflightError(f"resume=true but {err}") from err


def _check_weights(path: Path) -> None:
    """The weights file parses as safetensors (its header and size; values are read later)."""

    try:
        check_tensor_file(path)
    except DamagedFileError as err:
        raise PreflightError(f"weights-file {err}") from err


def _check_partitions(config: ExperimentConfig, num_clients: int, found: Preflight) -> None:
    """Every client's partition exists and holds at least the configured minimum."""

    try:
        counts = check_client_sizes(config, task_of(config).example_counts(config, num_clients))
    except (ValueError, DataUnavailableError) as err:
        raise PreflightError(str(err)) from err
    smallest = min(counts, key=lambda c: (c.train, c.test))
    found.notes.append(
        f"{num_clients} clients; the smallest holds {smallest.train} training and "
        f"{smallest.test} test examples"
    )
