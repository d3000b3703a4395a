"""Sweep cells as Ray tasks on a two-node local Ray cluster: the same results as the serial sweep
bit for bit, cells spread over both nodes, and a cell whose worker is killed resumes from its
checkpoint to the serial run's results."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client_apps.faults import RELEASE_FILE
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.simulation.processes import pid_alive, proc_stat
from fedfm_flower.study import sweep

ray = pytest.importorskip("ray")


def _sweep_argv(methods: list[str], out: Path, cache_dir: Path, rounds: int) -> list[str]:
    return [
        "--methods", *methods,
        "--setups", "digits-label-skew",
        "--seeds", "0",
        "--out", str(out),
        "--set", f"num-server-rounds={rounds}", "num-clients=2", f"cache-dir='{cache_dir}'",
        "pretrain-epochs=30",
    ]  # fmt: skip


def _metrics(run: Path) -> list[dict]:
    return RunDirectory(run).rounds_without_times()


@contextlib.contextmanager
def _ray_sweep(
    argv: list[str], address: str, environment: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """The sweep as its own Ray driver process, joining the cluster at ``address`` (killed if
    the test fails before it ends)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "fedfm_flower.sweep", *argv, "--ray-address", address],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[str]:
    """A local Ray cluster of two nodes with one CPU each; its address."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


ROUNDS = 3


@pytest.fixture(scope="module")
def serial(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """The serial sweep of fedavg and local (the reference of both tests), with one torch
    thread as a Ray cell of one CPU has (Ray sets its OMP_NUM_THREADS): on an AVX-512 CPU the
    thread count changes the sums' order, and so the last bits of every loss."""
    import torch

    out = tmp_path_factory.mktemp("serial")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert sweep.main(_sweep_argv(["fedavg", "local"], out, cache_dir, ROUNDS)) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_cells_on_two_ray_nodes_equal_the_serial_sweep(
    two_nodes: str, serial: Path, tmp_path: Path, cache_dir: Path
) -> None:
    parallel = tmp_path / "ray"
    argv = _sweep_argv(["fedavg", "local"], parallel, cache_dir, ROUNDS)
    with _ray_sweep(argv, two_nodes) as p:
        output, _ = p.communicate(timeout=900)
    assert p.returncode == 0, output[-3000:]

    cells = json.loads((parallel / "sweep.json").read_text())["cells"]
    assert [c["state"] for c in cells] == ["done", "done"]
    assert len({c["node"] for c in cells}) == 2  # one cell per node: both nodes worked
    for name in ("fedavg-digits-label-skew-s0", "local-digits-label-skew-s0"):
        ours, theirs = _metrics(parallel / "runs" / name), _metrics(serial / "runs" / name)
        assert len(ours) == ROUNDS and ours == theirs  # every value of every round, bit for bit


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` in the process tree."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := proc_stat(int(entry.name))):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _worker_pids(task: str) -> list[int]:
    """This test cluster's processes whose title says they run Ray task ``task`` (not those of
    another Ray instance on the machine, such as a sweep running beside the tests)."""
    pids = []
    for pid in _descendants(os.getpid()):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if title.startswith(f"ray::{task}"):
            pids.append(pid)
    return pids


def _held_cell(process: subprocess.Popen, run: RunDirectory, timeout: float) -> int:
    """The pid of the cell's worker once the run committed a checkpoint. The sweep runs with
    ``FEDFM_INJECT_FAULT=2:hold`` (the pool hands it to the cell): the cell waits at round 2's
    training until the test creates its clients' release files, so it cannot end before the
    kill however slowly this process is scheduled."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no checkpoint of a running cell within {timeout} s"
        pids = _worker_pids("_ray_cell")
        if len(pids) == 1 and run.checkpoint_rounds():
            return pids[0]
        time.sleep(0.05)


def test_a_cell_whose_worker_is_killed_resumes_from_its_checkpoint(
    two_nodes: str, serial: Path, tmp_path: Path, cache_dir: Path
) -> None:
    name, parallel = "fedavg-digits-label-skew-s0", tmp_path / "ray"
    run = RunDirectory(parallel / "runs" / name)
    environment = {**os.environ, "FEDFM_INJECT_FAULT": "2:hold"}
    argv = _sweep_argv(["fedavg"], parallel, cache_dir, ROUNDS)
    with _ray_sweep(argv, two_nodes, environment) as p:
        pid = _held_cell(p, run, timeout=600)
        time.sleep(1.0)
        # Still at round 2: the driver's setting reached the Ray worker.
        assert run.checkpoint_rounds() == [1] and not (run.path / "summary.json").exists()
        os.kill(pid, signal.SIGKILL)
        for client in range(2):  # the retry's round 2 goes on
            held = parallel / "client-state" / name / f"client_{client}"
            held.mkdir(parents=True, exist_ok=True)
            (held / RELEASE_FILE).touch()
        output, _ = p.communicate(timeout=900)
    assert p.returncode == 0, output[-3000:]

    (record,) = json.loads((parallel / "sweep.json").read_text())["cells"]
    assert record["state"] == "done" and record["state-before"] == "interrupted"  # the retry
    ours, theirs = _metrics(parallel / "runs" / name), _metrics(serial / "runs" / name)
    assert [r["round"] for r in ours] == list(range(1, ROUNDS + 1))  # each round once
    assert ours == theirs


def test_a_stopped_sweep_shuts_down_the_ray_instance_it_started(
    tmp_path: Path, cache_dir: Path
) -> None:
    """SIGTERM (a scheduler, ``timeout``) to a ``--ray`` sweep while its cell runs: the sweep
    exits within seconds and leaves no Ray process behind (Ctrl-C takes the same path)."""
    out = tmp_path / "stopped"
    run = RunDirectory(out / "runs" / "fedavg-digits-label-skew-s0")
    argv = [sys.executable, "-m", "fedfm_flower.sweep", "--ray"]
    argv += _sweep_argv(["fedavg"], out, cache_dir, 500)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not run.checkpoint_rounds():  # the cell is running in a Ray worker
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no cell running within 300 s"
            time.sleep(0.2)
        started = _descendants(process.pid)  # the GCS, the raylet, the cell's worker, ...
        assert len(started) >= 3
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    # 143 (SystemExit from processes.exit_on_sigterm), or 1 where the signal arrived inside
    # Ray's wait, which turns the handler's SystemExit into its own SystemExit(1).
    assert process.returncode in (1, 143), output[-3000:]  # 2 would be a refused start
    assert "Traceback" not in output, output[-3000:]
    assert "interrupted: rerun the same command to resume" in output, output[-3000:]
    assert max(run.checkpoint_rounds()) < 500  # stopped mid-cell, not after it
    deadline = time.monotonic() + 30
    while [pid for pid in started if pid_alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in started if pid_alive(pid)], "Ray processes left running"
