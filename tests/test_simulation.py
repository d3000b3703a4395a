"""`flwr run` in local simulation (Ray), through the project's launcher, cleaned up afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedfm_flower.processes import pids_with_environment
from fedfm_flower.simulation import local_superlink_pids

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_flwr_run_simulation_writes_a_run_and_leaves_nothing_running(
    cache_dir: Path, tmp_path: Path
) -> None:
    flwr_home = tmp_path / "flwr-home"
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "runs"
    overrides = (
        f"method='fedavg' num-server-rounds=2 run-name='sim' cache-dir='{cache_dir}' "
        f"output-dir='{out}' pretrain-epochs=30"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedfm_flower.simulation",
            "--num-supernodes",
            "3",
            "--",
            "--run-config",
            overrides,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "[round   2/2] acc" in output  # the per-round progress line reaches the user
    rounds = [json.loads(x) for x in (out / "sim" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["clients-reported"] == 3 for r in rounds)
    summary = json.loads((out / "sim" / "summary.json").read_text())
    assert summary["final-test-accuracy-mean"] > 0.2
    assert local_superlink_pids(flwr_home) == []


def test_sigterm_runs_the_clean_ups(tmp_path: Path) -> None:
    """With ``exit_on_sigterm`` a SIGTERM ends the process through ``finally`` (exit 143)."""
    import signal
    import time

    marker = tmp_path / "cleaned-up"
    script = (
        "import sys, time\n"
        "from fedfm_flower.processes import exit_on_sigterm\n"
        "exit_on_sigterm()\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "finally:\n"
        f"    open({str(marker)!r}, 'w').write('done')\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 143
    assert time.monotonic() - started < 20
    assert marker.read_text() == "done"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launcher_stopped_with_sigterm_leaves_no_superlink(cache_dir: Path, tmp_path: Path) -> None:
    """A launcher stopped mid-run (timeout, scheduler) still stops the detached SuperLink that
    `flwr run` started, so no later `flwr run` can land in it."""
    import signal
    import time

    flwr_home = tmp_path / "flwr-home"
    env = {**os.environ, "FLWR_HOME": str(flwr_home), "HF_HUB_OFFLINE": "1"}
    overrides = (
        f"method='fedavg' num-server-rounds=50 run-name='stopped' cache-dir='{cache_dir}' "
        f"output-dir='{tmp_path / 'runs'}' pretrain-epochs=30"
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedfm_flower.simulation",
            "--num-supernodes",
            "2",
            "--",
            "--run-config",
            overrides,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tag = {"FLWR_HOME": str(flwr_home)}
    deadline = time.monotonic() + 180
    while not pids_with_environment(tag, command="raylet") and time.monotonic() < deadline:
        assert process.poll() is None, "the launcher ended before the simulation started"
        time.sleep(0.5)
    assert pids_with_environment(tag, command="raylet"), "Ray did not start within 180 s"
    assert local_superlink_pids(flwr_home)
    process.send_signal(signal.SIGTERM)  # mid-run: SuperLink, ServerApp and Ray are all up
    assert process.wait(timeout=60) == 143
    assert local_superlink_pids(flwr_home) == []
    # nor anything it started: every process of the run carries this FLWR_HOME
    deadline = time.monotonic() + 20
    while pids_with_environment(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pids_with_environment(tag) == set()
