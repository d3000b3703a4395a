"""Helpers of the real-deployment tests: fedfm_flower.deploy, results, process checks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fedfm_flower.deploy import HOST, tagged_pids
from fedfm_flower.simulation.processes import pid_alive

ROOT = Path(__file__).resolve().parent.parent


def assert_all_gone(deployment: Any) -> None:
    """No process this deployment started (or that carries its tag) is still running."""
    started = {process.pid for process in deployment.processes}
    assert started <= deployment.seen_pids
    alive = sorted(pid for pid in deployment.seen_pids if pid_alive(pid))
    # A pid could in theory be reused by an unrelated process: only ours carry the tag.
    tagged = tagged_pids(deployment.tag)
    assert not tagged, f"processes of the deployment still running: {sorted(tagged)}"
    assert all(process.popen.returncode is not None for process in deployment.processes)
    assert not (set(alive) & started), f"started processes still alive: {alive}"


def read_rounds(run_dir: Path) -> list[dict[str, Any]]:
    """The per-round records of a run directory."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rounds_recorded(run_dir: Path) -> int:
    """How many rounds metrics.jsonl holds so far: complete lines only (for waits while the
    ServerApp appends)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return 0
    return text.count("\n")


def hash_files(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory``, by relative path."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def assert_secure(deployment: Any) -> None:
    """TLS everywhere and SuperNode authentication with registered keys, on 127.0.0.1 only."""
    assert not deployment.options.insecure
    superlink_cmd = deployment.superlink.command
    assert "--enable-supernode-auth" in superlink_cmd and "--ssl-certfile" in superlink_cmd
    assert "--insecure" not in superlink_cmd
    for node in deployment.supernodes:
        assert "--auth-supernode-private-key" in node.command
        assert "--root-certificates" in node.command
        assert "--insecure" not in node.command
    assert len(deployment.node_ids) == deployment.options.num_supernodes
    flwr_config = (deployment.flwr_home / "config.toml").read_text()
    assert "root-certificates" in flwr_config and "insecure" not in flwr_config
    assert deployment.address.startswith(f"{HOST}:")


def completed_log(deployment: Any, result: Any) -> str:
    """After ``deployment.stop()``: nothing left running, secure mode used, the run completed;
    returns the run's log."""
    assert_all_gone(deployment)
    assert_secure(deployment)
    log = result.log_path.read_text()
    assert result.ok, f"run status {result.status}; log:\n{log[-3000:]}"
    return log
