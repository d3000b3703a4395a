"""What both launchers share once a run is submitted: exit codes, Flower's verdict, the stream.

``flwr run --stream`` exits 0 whether or not the run completed, so the launchers ask the
SuperLink for the run's final status (``flwr ls --run-id``) and turn it into their exit code.
``fedfm_flower.records.tracebacks.StreamFilter`` shortens what the user sees of the run's stream.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from enum import IntEnum


class ExitCode(IntEnum):
    """Exit statuses of ``python -m fedfm_flower.simulation`` and ``fedfm_flower.deploy``."""

    COMPLETED = 0  # Flower reports the run finished:completed
    FAILED = 1  # the run started and did not complete (ServerApp error, every client failed)
    BAD_INPUT = 2  # bad arguments, run config or files: nothing was started
    NOT_STARTED = 3  # Flower or the federation could not start the run
    TIMEOUT = 124  # the launcher's time limit stopped the run (as coreutils' timeout)
    INTERRUPTED = 130  # Ctrl-C


COMPLETED_STATUS = "finished:completed"
_RUN_STARTED = re.compile(r"Successfully started run (\d+)")
_EXCEPTION_PREFIX = re.compile(r"^\w+ failed with exception: ")


def run_id_from_lines(lines: Sequence[str]) -> int | None:
    """The run id ``flwr run`` printed ("Successfully started run N"), or None."""
    for line in lines:
        match = _RUN_STARTED.search(line)
        if match:
            return int(match.group(1))
    return None


def parse_run_status(stdout: str) -> tuple[str, str] | None:
    """(status, details) from ``flwr ls --run-id N --format json``; None when unreadable."""
    with contextlib.suppress(json.JSONDecodeError, AttributeError, IndexError, KeyError):
        run = json.loads(stdout)["runs"][0]
        return str(run["status"]), _EXCEPTION_PREFIX.sub("", str(run.get("status-details", "")))
    return None


def final_run_status(
    flwr: str,
    connection: str,
    run_id: int,
    env: Mapping[str, str],
    cwd: str | None = None,
    attempts: int = 20,
) -> tuple[str, str]:
    """(status, details) of a run once the SuperLink reports it finished; ("unknown", why)
    when it does not within ``attempts`` polls half a second apart."""
    last = "the SuperLink did not answer"
    for _ in range(attempts):
        result = subprocess.run(
            [flwr, "ls", connection, "--run-id", str(run_id), "--format", "json"],
            env=dict(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        parsed = parse_run_status(result.stdout)
        if parsed is not None:
            if parsed[0].startswith("finished"):
                return parsed
            last = f"still {parsed[0]}"
        time.sleep(0.5)
    return "unknown", last


def exit_code_for_status(status: str) -> ExitCode:
    """COMPLETED for Flower's "finished:completed", FAILED for any other outcome."""
    return ExitCode.COMPLETED if status == COMPLETED_STATUS else ExitCode.FAILED
