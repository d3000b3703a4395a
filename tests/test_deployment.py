"""Operator-side checks of the launcher (fedfm_flower.deploy) on 127.0.0.1: an unregistered
SuperNode key is refused, an unreachable SuperLink and missing certificates are clear errors,
certificates and keys are generated, run configs merge. Complete secure runs (and their faults)
are in test_faults.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from deploy_support import ROOT, assert_all_gone

from fedfm_flower.deploy import (
    CERT_FILES,
    DeploymentError,
    DeployOptions,
    LocalDeployment,
    RunConfigError,
    RunResult,
    ensure_certificates,
    ensure_supernode_keys,
    generate_supernode_key,
    parse_run_config,
    resolve_run_config,
)


@pytest.fixture
def options(tmp_path: Path):
    """Secure (default) options with a private work directory and a free port block."""
    return DeployOptions(
        num_supernodes=2,
        workdir=tmp_path / "work",
        startup_timeout=90.0,
        run_timeout=240.0,
        echo=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_supernode_with_unregistered_key_is_refused(options):
    options.num_supernodes = 1
    deployment = LocalDeployment(options)
    try:
        deployment.prepare()
        deployment.start_superlink()
        rogue_key = options.workdir / "rogue" / "rogue_key"
        generate_supernode_key(rogue_key)  # never registered
        rogue = deployment.start_supernode(0, private_key=rogue_key, name="rogue")
        deadline = time.monotonic() + 60
        while rogue.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not rogue.alive(), "a SuperNode with an unregistered key kept running"
        rogue.join_output()
        assert rogue.popen.returncode != 0
        assert "Failed to activate SuperNode" in "\n".join(rogue.lines)
        assert deployment.online_nodes() == []
        # Control: the same SuperLink accepts a SuperNode whose key is registered.
        deployment.register_key(deployment.keys[0].with_suffix(".pub"))
        deployment.start_supernode(0)
        deployment.wait_for_supernodes(1, timeout=60)
    finally:
        deployment.stop()
    assert_all_gone(deployment)
    superlink_log = deployment.superlink.log_path.read_text()
    assert "No SuperNode found with the given public key" in superlink_log


@pytest.mark.timeout(60)
def test_unreachable_superlink_is_a_clear_error_and_cleans_up(options):
    options.startup_timeout = 0.01  # no SuperLink is ready within 10 ms
    deployment = LocalDeployment(options)
    with pytest.raises(DeploymentError, match="SuperLink not reachable at 127.0.0.1:"):
        with deployment:
            deployment.prepare()
            deployment.start_superlink()
    assert_all_gone(deployment)


def test_deployments_starting_at_once_reserve_different_port_blocks(options):
    """The block a deployment prepared stays its own until it stops: another deployment of
    this user preparing meanwhile, when every port of that block is still free (its SuperLink
    not started), takes the next block; after the first stops, its block is free again; a
    requested base port another deployment holds is refused naming it."""
    import dataclasses

    first = LocalDeployment(options)
    second = LocalDeployment(dataclasses.replace(options, workdir=options.workdir / "second"))
    try:
        first.prepare()
        second.prepare()
        assert first.base_port is not None and second.base_port is not None
        assert abs(second.base_port - first.base_port) >= options.num_supernodes + 1
        third = dataclasses.replace(
            options, base_port=first.base_port, workdir=options.workdir / "3"
        )
        with pytest.raises(DeploymentError, match=f"base port {first.base_port} .* another"):
            LocalDeployment(third).prepare()
    finally:
        first.stop()
        second.stop()
    # Released by stop(): the block can be asked for by number again.
    again = dataclasses.replace(options, base_port=first.base_port, workdir=options.workdir / "4")
    deployment = LocalDeployment(again)
    try:
        deployment.prepare()
        assert deployment.base_port == first.base_port
    finally:
        deployment.stop()


def test_missing_certificates_are_a_clear_error(tmp_path: Path):
    options = DeployOptions(workdir=tmp_path / "work", certs_dir=tmp_path / "nowhere")
    with pytest.raises(DeploymentError, match=r"missing TLS file\(s\) .*ca\.crt"):
        ensure_certificates(options)
    options = DeployOptions(workdir=tmp_path / "work", keys_dir=tmp_path / "nokeys")
    with pytest.raises(DeploymentError, match="missing SuperNode key"):
        ensure_supernode_keys(options)


def test_default_certificates_and_keys_are_generated(tmp_path: Path):
    options = DeployOptions(num_supernodes=2, workdir=tmp_path / "work")
    certs = ensure_certificates(options)
    assert all((certs / name).is_file() for name in CERT_FILES)
    # and nothing else: no work file of the script's is left
    assert sorted(p.name for p in certs.iterdir()) == sorted([*CERT_FILES, "ca.key"])
    keys = ensure_supernode_keys(options)
    assert [k.name for k in keys] == ["supernode_0", "supernode_1"]
    assert keys[0].with_suffix(".pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    assert (keys[0].stat().st_mode & 0o077) == 0  # private key readable by the owner only


def test_run_config_merging(tmp_path: Path):
    toml_file = tmp_path / "extra.toml"
    toml_file.write_text('method = "fedrep"\nseed = 3\n')
    merged = parse_run_config([str(toml_file), "seed=4 output-dir='out'"])
    assert merged == {"method": "fedrep", "seed": 4, "output-dir": "out"}
    resolved = resolve_run_config(merged, 3, ROOT, base=tmp_path)
    assert resolved["num-clients"] == 3
    assert resolved["output-dir"] == str(tmp_path / "out")
    assert resolve_run_config({}, 2, ROOT)["output-dir"] == str(ROOT / "runs")
    with pytest.raises(RunConfigError, match="unknown run-config key"):
        resolve_run_config({"no-such-key": 1}, 2, ROOT)
    with pytest.raises(RunConfigError, match="differs from --num-supernodes"):
        resolve_run_config({"num-clients": 5}, 2, ROOT)
    with pytest.raises(RunConfigError, match="cannot parse"):
        parse_run_config(["method=fedavg"])  # strings need quotes, as with `flwr run`


def _deploy(args: list[str], tmp_path: Path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "scripts/deploy_local.py", "--workdir", str(tmp_path / "work"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )


def test_script_and_module_are_the_same_command():
    import subprocess
    import sys

    def options(command: list[str]) -> str:
        result = subprocess.run(
            [sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.partition("options:")[2]

    script = options(["scripts/deploy_local.py"])
    assert "--num-supernodes" in script
    assert options(["-m", "fedfm_flower.deploy"]) == script


def test_the_deploy_script_runs_the_checkout_it_belongs_to(tmp_path: Path):
    """Another clone's package first on the path (its PYTHONPATH, a venv installed from it):
    the script still deploys, and writes into, its own checkout."""
    import os
    import subprocess
    import sys

    other = tmp_path / "other-clone" / "fedfm_flower"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("raise ImportError('the other clone was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(other.parent)}
    show_root = "import fedfm_flower.deploy.cli as cli\nprint(cli.ROOT)\n"
    through_script = (
        f"import runpy\nrunpy.run_path({str(ROOT / 'scripts' / 'deploy_local.py')!r})\n"
    )

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
        )

    assert "the other clone was imported" in run(show_root).stderr  # the decoy is first
    result = run(through_script + show_root)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == ROOT


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("method='fedsgd'", "run config 'method' = 'fedsgd' is invalid"),
        ("resume=true run-name='nope'", "resume=true but run directory .*/nope does not exist"),
        ("min-test-examples=100000", "fewer than min-train-examples = 10 / min-test-examples"),
    ],
)
def test_deploy_refuses_bad_input_in_one_line_before_starting(
    override: str, message: str, cache_dir: Path, tmp_path: Path
) -> None:
    import re

    common = f"cache-dir='{cache_dir}' output-dir='{tmp_path / 'runs'}'"
    result = _deploy(["--run-config", f"{override} {common}"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "work").exists()  # no certificate, key or process was made


def test_deploy_without_flowers_commands_says_where_it_looked_in_one_line_and_exits_2(
    flowerless_interpreter: Path, tmp_path: Path, capsys
) -> None:
    from fedfm_flower.deploy.cli import main

    assert main(["--workdir", str(tmp_path / "work"), "--no-run"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: Flower's `flwr` command not found: looked for ")
    assert f"on PATH ({flowerless_interpreter})" in lines[0]
    assert "Traceback" not in captured.out + captured.err
    assert not (tmp_path / "work").exists()  # no certificate, key or process was made


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ("finished:completed", 0),
        ("finished:failed", 1),
        ("finished:stopped", 1),
        ("unknown", 1),
        ("not-started", 3),
        ("timeout", 124),
    ],
)
def test_deploy_exit_status_follows_the_run_status(status: str, code: int, tmp_path: Path):
    result = RunResult(1, status, 0, 1.0, None, tmp_path / "flwr_run.log")
    assert result.exit_code == code
    assert result.ok == (code == 0)


def test_the_fab_holds_the_apps_code_and_configs_and_the_staged_app_builds_it_exactly(
    tmp_path: Path,
) -> None:
    """Flower's own builder packs this project as every run's FAB: the packages the apps import
    and the setup configs, not results, docs, tests or the bench, well under Flower's 10 MB
    limit; the staged copy ``flwr run`` builds from gives the same FAB, byte for byte."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk
    from flwr.common.constant import FAB_MAX_SIZE

    from fedfm_flower.simulation.app_stage import stage_app

    fab = build_fab_from_disk(ROOT)
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert {"fedfm_flower", "client_apps", "server_apps", "strategies", "configs"} <= tops
    assert {"client_apps/app.py", "server_apps/app.py", "configs/setups/glyphs-whole-vit.toml"} <= (
        set(names)
    )
    assert not tops & {"docs", "tests", "bench", "scripts"}
    assert len(fab) < FAB_MAX_SIZE / 4, len(fab)

    stage = stage_app(ROOT, tmp_path / "stage")
    assert build_fab_from_disk(stage) == fab
    (stage / "stale.py").write_text("")
    stage_app(ROOT, stage)  # a fresh copy each time: nothing left from the last one
    assert not (stage / "stale.py").exists() and build_fab_from_disk(stage) == fab
