"""`flwr run` in local simulation (Ray), through the project's launcher, cleaned up afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
