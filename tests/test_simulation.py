"""`flwr run` in local simulation (forked workers on the CPU, or Ray), through the project's
launcher, cleaned up afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedfm_flower.records.results import RunDirectory
from fedfm_flower.simulation.launcher import local_superlink_pids
from fedfm_flower.simulation.processes import pids_with_environment

ROOT = Path(__file__).resolve().parent.parent


def simulate(
    cache_dir: Path,
    tmp_path: Path,
    name: str,
    prompt_engine: bool,
    extra: str = "",
    backend: str = "fork",
) -> list[dict]:
    """``flwr run`` of 2 FedAvg rounds on 3 SuperNodes through the launcher (``extra``: more
    run-config overrides; ``backend``: ``fork`` or ``ray``); its rounds without their
    wall-clock values."""
    flwr_home = tmp_path / f"flwr-home-{name}"
    env = {
        **os.environ,
        "FLWR_HOME": str(flwr_home),
        "HF_HUB_OFFLINE": "1",
        "FEDFM_PROMPT_ENGINE": "1" if prompt_engine else "0",
        "FEDFM_SIMULATION_ENGINE": backend,
    }
    out = tmp_path / "runs"
    overrides = (
        f"method='fedavg' num-server-rounds=2 run-name='{name}' cache-dir='{cache_dir}' "
        f"output-dir='{out}' pretrain-epochs=30 {extra}"
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
    assert "keeps Flower's 0.1 s hand-offs" not in output  # the installed Flower is known
    assert ("in workers forked from one process (started by the launcher" in output) == (
        backend == "fork"
    )
    rounds = RunDirectory(out / name).rounds_without_times()
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["clients-reported"] == 3 for r in rounds)
    summary = json.loads((out / name / "summary.json").read_text())
    assert summary["final-test-accuracy-mean"] > 0.2
    assert local_superlink_pids(flwr_home) == []
    return rounds


@pytest.mark.slow
@pytest.mark.timeout(800)
def test_flwr_run_simulation_writes_a_run_and_leaves_nothing_running(
    cache_dir: Path, tmp_path: Path
) -> None:
    """A simulated run as by default (forked workers, prompt hand-offs) and as Flower runs it
    (Ray's actors, 0.1 s hand-offs): the same results, every value of every round (times
    aside)."""
    ours = simulate(cache_dir, tmp_path, "ours", prompt_engine=True)
    flower = simulate(cache_dir, tmp_path, "flower", prompt_engine=False, backend="ray")
    assert ours == flower


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flwr_run_simulation_with_secagg(cache_dir: Path, tmp_path: Path) -> None:
    """SecAgg+ in Flower's simulation engine (on Ray, with the prompt hand-offs): the 4 stages
    complete every round with all 3 clients in the sum, and the training replies carry no
    arrays (only the protocol's records); that its mean equals the plain one is checked in
    tests/test_secagg.py."""
    rounds = simulate(
        cache_dir, tmp_path, "secagg", prompt_engine=True, extra="secagg=true", backend="ray"
    )
    assert [r["server"]["secagg-clients"] for r in rounds] == [3.0, 3.0]
    assert all(r["bytes-up-train"] == 0 and r["bytes-up-secagg"] > 0 for r in rounds)


def test_loading_the_clientapp_in_the_simulation_process_installs_the_prompt_hand_offs() -> None:
    """The engine imports the ClientApp's module before it starts its threads (Flower 1.42's
    ``start_vce``); that import puts the prompt functions in place (a fresh process)."""
    script = (
        "import flwr.server.superlink.fleet.vce.vce_api as engine\n"
        "import client_apps.app\n"
        "print(engine.add_messages_to_queue.__module__, engine.put_message_into_state.__module__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "FEDFM_PROMPT_ENGINE"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["fedfm_flower.simulation.prompt_engine"] * 2


def test_sigterm_runs_the_clean_ups(tmp_path: Path) -> None:
    """With ``exit_on_sigterm`` a SIGTERM ends the process through ``finally`` (exit 143)."""
    import signal
    import time

    marker = tmp_path / "cleaned-up"
    script = (
        "import sys, time\n"
        "from fedfm_flower.simulation.processes import exit_on_sigterm\n"
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

    def forked() -> set[int]:  # the fork server and the workers it forked (its command line)
        return pids_with_environment(tag, command="fedfm_flower.deploy.forkserver")

    deadline = time.monotonic() + 180
    while len(forked()) < 2 and time.monotonic() < deadline:
        assert process.poll() is None, "the launcher ended before the simulation started"
        time.sleep(0.5)
    assert len(forked()) >= 2, "no worker was forked within 180 s"
    assert local_superlink_pids(flwr_home)
    process.send_signal(signal.SIGTERM)  # mid-run: SuperLink, ServerApp and workers are all up
    assert process.wait(timeout=60) == 143
    assert local_superlink_pids(flwr_home) == []
    # nor anything it started: every process of the run carries this FLWR_HOME (60 s: Ray's
    # workers, with FEDFM_SIMULATION_ENGINE=ray, took over 20 s to exit on a loaded machine).
    deadline = time.monotonic() + 60
    while pids_with_environment(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pids_with_environment(tag) == set()


def _launch(
    args: list[str], tmp_path: Path, extra_env: dict | None = None, timeout: float = 400
) -> subprocess.CompletedProcess:
    """Run the real launcher with a private FLWR_HOME."""
    env = {
        **os.environ,
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        "HF_HUB_OFFLINE": "1",
        **(extra_env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "fedfm_flower.simulation", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# The bad inputs of issue 13, each refused before Flower, Ray or a SuperLink starts.
BAD_INPUTS = {
    "unknown-method": ("method='fedsgd'", "run config 'method' = 'fedsgd' is invalid: allowed:"),
    "negative-rank": ("lora-rank=-1", "run config 'lora-rank' = -1 is invalid: must be > 0"),
    "resume-missing": (
        "resume=true run-name='does-not-exist'",
        "resume=true but run directory .*/does-not-exist does not exist",
    ),
    "tiny-partition": (
        "dataset='digits-domains' dirichlet-alpha=0.1 seed=1",
        "client 4 of 8 holds 1 training and 1 test examples, fewer than min-train-examples",
    ),
    "unknown-key": ("lora-rnak=4", "unknown run-config key\\(s\\) lora-rnak"),
    "nan-noise": (
        "method='fedavg' dp='local' dp-noise-multiplier=nan",
        "run config 'dp-noise-multiplier' = nan is invalid: must be a finite number",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_launcher_refuses_bad_input_in_one_line_before_starting(
    case: str, cache_dir: Path, tmp_path: Path
) -> None:
    import re

    override, message = BAD_INPUTS[case]
    common = f"cache-dir='{cache_dir}' output-dir='{tmp_path / 'runs'}'"
    result = _launch(["--num-supernodes", "8", "--", "-c", f"{override} {common}"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "flwr-home").exists()  # flwr run never ran
    if case == "unknown-method":  # --debug keeps the traceback
        debug = _launch(["--debug", "--", "-c", f"{override} {common}"], tmp_path)
        assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr


def test_launcher_refuses_an_app_whose_fab_cannot_be_built_in_one_line(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from fedfm_flower.simulation import launcher as simulation

    def refuse(app: Path, stage: Path) -> Path:
        raise ValueError('Pattern in "fab-include" did not match any files: "/nothing/**"')

    monkeypatch.setattr(simulation, "stage_app", refuse)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    common = f"cache-dir='{cache_dir}' output-dir='{tmp_path / 'runs'}' num-server-rounds=1"
    assert simulation.main(["--num-supernodes", "2", "--", "-c", common]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith('error: the app\'s FAB cannot be built: Pattern in "fab-include"')
    assert not (tmp_path / "flwr-home" / "local-superlink").exists()  # flwr run never ran


def test_flower_commands_are_found_beside_the_interpreter_then_on_path(
    flowerless_interpreter: Path,
) -> None:
    from fedfm_flower.simulation.processes import FlowerCommandNotFound, flower_command

    scripts = flowerless_interpreter
    fake = scripts / "flwr"
    fake.write_text("#!/bin/sh\necho fake flwr\n")
    fake.chmod(0o755)
    assert flower_command("flwr") == str(scripts / "flwr")  # as after `pip install --target`
    beside = Path(sys.executable).parent / "flwr"
    beside.write_text("#!/bin/sh\n")
    beside.chmod(0o755)
    assert flower_command("flwr") == str(beside)  # this interpreter's own Flower comes first
    with pytest.raises(FlowerCommandNotFound, match="flower-superlink"):
        flower_command("flower-superlink")


def test_launcher_without_flwr_says_where_it_looked_in_one_line_and_exits_2(
    flowerless_interpreter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from fedfm_flower.simulation import launcher as simulation

    scripts = flowerless_interpreter
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    assert simulation.main(["--num-supernodes", "2"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    beside = tmp_path / "python" / "bin" / "flwr"
    assert lines[0].startswith("error: Flower's `flwr` command not found")
    assert f"looked for {beside}" in lines[0] and f"on PATH ({scripts})" in lines[0]
    assert "install Flower into this interpreter" in lines[0] and "on PATH" in lines[0]
    assert "Traceback" not in captured.out + captured.err
    assert not (tmp_path / "flwr-home").exists()  # nothing started


def test_launcher_takes_a_run_config_file_relative_to_the_app(tmp_path: Path) -> None:
    from fedfm_flower.simulation.launcher import preflight, run_config_items

    args = ["--stream", "-c", "configs/fedavg/digits-label-skew.toml"]
    assert run_config_items(args) == ["configs/fedavg/digits-label-skew.toml"]
    assert run_config_items(["--run-config", "a=1", "-c", "b=2"]) == ["a=1", "b=2"]
    checked = preflight(ROOT, ["-c", "configs/fedavg/digits-label-skew.toml"], 10)
    assert checked.config.method == "fedavg"
    assert Path(checked.config.output_dir) == ROOT / "runs"  # relative to the app directory
    assert any("10 clients; the smallest holds" in note for note in checked.notes)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launcher_exits_1_when_every_client_fails(cache_dir: Path, tmp_path: Path) -> None:
    overrides = (
        f"method='fedavg' num-server-rounds=2 run-name='dead' cache-dir='{cache_dir}' "
        f"output-dir='{tmp_path / 'runs'}' pretrain-epochs=30"
    )
    result = _launch(
        ["--num-supernodes", "2", "--", "--run-config", overrides],
        tmp_path,
        {"FEDFM_INJECT_FAULT": "1:crash"},  # every simulated ClientApp crashes in round 1
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert (
        error.startswith("error: run ") and " finished:failed: round 1: no client returned" in error
    )
    assert "InjectedCrash: fault injection: this ClientApp crashes on purpose" in error
    assert "Traceback" not in output  # folded; the launcher's log keeps them
    log_path = Path(error.rsplit("; log ", 1)[1])
    assert "Traceback (most recent call last)" in log_path.read_text()
    run_dir = tmp_path / "runs" / "dead"
    assert "RunFailed: round 1" in json.loads((run_dir / "failure.json").read_text())["error"]
    assert not (run_dir / "summary.json").exists()
    assert local_superlink_pids(tmp_path / "flwr-home") == []


def test_launcher_timeout_stops_the_run_and_returns_124(tmp_path: Path, monkeypatch) -> None:
    """Past --timeout the launcher asks the SuperLink to stop the run and returns 124; its
    ``finally`` then stops everything, as test_launcher_stopped_with_sigterm_... checks."""
    from fedfm_flower.simulation import launcher as simulation
    from fedfm_flower.simulation.verdict import ExitCode

    calls: list[list[str]] = []
    monkeypatch.setattr(simulation.subprocess, "run", lambda command, **_: calls.append(command))
    started = ["Successfully started run 7\n"]
    running = subprocess.Popen(["sleep", "30"])
    try:
        code = simulation._wait(running, 0.2, "flwr", {}, tmp_path, started)
    finally:
        running.kill()
        running.wait()
    assert code == ExitCode.TIMEOUT == 124
    assert calls == [["flwr", "stop", "7", "local"]]
    finished = subprocess.Popen(["true"])
    assert simulation._wait(finished, 10, "flwr", {}, tmp_path, started) is None
    assert len(calls) == 1  # a run that ends in time is not stopped


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_main_sh_exits_with_the_launchers_status(tmp_path: Path) -> None:
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")}
    result = subprocess.run(
        ["bash", "scripts/main.sh", "-c", "method='fedsgd'"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "error: run config 'method' = 'fedsgd' is invalid" in result.stderr


def test_setup_refuses_a_python_older_than_the_dependencies_need(tmp_path: Path) -> None:
    import shutil

    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    old = tmp_path / "python3.10"  # answers like a Python 3.10 interpreter
    old.write_text(
        '#!/bin/sh\ncase "$*" in *version_info*) exit 1;; *python_version*) echo 3.10.12;; esac\n'
    )
    old.chmod(0o755)
    result = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "setup.sh")],
        env={**os.environ, "PYTHON": str(old)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "needs Python >= 3.11" in result.stderr and "is Python 3.10.12" in result.stderr
    assert not (tmp_path / ".venv").exists()


def test_requires_python_is_what_the_dependencies_require() -> None:
    import re
    import tomllib
    from importlib import metadata

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = max(
        tuple(int(x) for x in re.search(r">=\s*([\d.]+)", need).group(1).split(".")[:2])
        for need in (metadata.metadata(d)["Requires-Python"] for d in ("flwr", "flwr-datasets"))
    )
    assert declared == f">={minimum[0]}.{minimum[1]}"
    readme = (ROOT / "README.md").read_text()
    assert f"Python {minimum[0]}.{minimum[1]}+" in readme


def _fake_local_superlink(flwr_home: Path) -> subprocess.Popen:
    """A process whose command line is a local SuperLink's of ``flwr_home`` (it only sleeps)."""
    log = flwr_home / "local-superlink" / "superlink.log"
    command = ["flower-superlink", "-c", "import time; time.sleep(60)", "--log-file", str(log)]
    return subprocess.Popen(command, executable=sys.executable)


def test_launcher_refuses_while_a_local_superlink_of_another_flwr_home_runs(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """Flower's local SuperLink has one fixed address: the launcher must not let `flwr run` send
    the run into another FLWR_HOME's SuperLink, nor stop that SuperLink; its own stale ones it
    stops."""
    from types import SimpleNamespace

    from fedfm_flower.simulation import launcher as simulation
    from fedfm_flower.simulation.processes import pid_alive
    from fedfm_flower.simulation.verdict import ExitCode

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    monkeypatch.setenv("FLWR_HOME", str(ours))
    checked = SimpleNamespace(notes=[], config=SimpleNamespace(output_dir=str(tmp_path / "runs")))
    monkeypatch.setattr(simulation, "preflight", lambda *_: checked)

    def no_flwr_run(*args, **kwargs):
        raise AssertionError("flwr run must not start")

    stale, foreign = _fake_local_superlink(ours), _fake_local_superlink(theirs)
    monkeypatch.setattr(simulation.subprocess, "Popen", no_flwr_run)
    try:
        for _ in range(100):  # until both command lines are readable
            found = simulation.local_superlinks()
            if stale.pid in found and foreign.pid in found:
                break
            time.sleep(0.05)
        assert simulation.local_superlink_pids(ours) == [stale.pid]
        assert simulation.foreign_local_superlinks(ours) == {
            foreign.pid: theirs / "local-superlink" / "superlink.log"
        }
        code = simulation.main(["--num-supernodes", "2"])
        error = capsys.readouterr().err
        assert code == ExitCode.NOT_STARTED
        assert f"a local SuperLink of another FLWR_HOME ({theirs}) is running" in error
        assert f"(pid {foreign.pid})" in error and f"kill {foreign.pid}" in error
        assert stale.wait(timeout=15) is not None  # ours, stale: stopped
        assert pid_alive(foreign.pid)  # theirs: left alone
    finally:
        for process in (stale, foreign):
            process.kill()
            process.wait()


def test_launcher_refuses_an_unknown_simulation_engine_in_one_line(tmp_path: Path) -> None:
    result = _launch(["--num-supernodes", "2"], tmp_path, {"FEDFM_SIMULATION_ENGINE": "rey"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: FEDFM_SIMULATION_ENGINE='rey' is invalid: use 'fork' or 'ray'"
    ]
    assert not (tmp_path / "flwr-home").exists()  # flwr run never ran
