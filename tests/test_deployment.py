"""Real deployment on 127.0.0.1 with scripts/deploy_local.py: SuperLink + SuperNodes, TLS and
SuperNode authentication (the script's secure default), a 2-round fedavg run, and no process left
behind. Slow (a fresh ``flwr-clientapp`` process per message), but part of the default suite.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from deploy_support import ROOT, assert_all_gone, dl, read_rounds


@pytest.fixture
def options(tmp_path: Path):
    """Secure (default) options with a private work directory and a free port block."""
    return dl.DeployOptions(
        num_supernodes=2,
        workdir=tmp_path / "work",
        startup_timeout=90.0,
        run_timeout=240.0,
        echo=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_secure_deployment_runs_two_fedavg_rounds(options, cache_dir: Path, tmp_path: Path):
    output_dir = tmp_path / "runs"
    run_config = {
        "method": "fedavg",
        "num-server-rounds": 2,
        "num-clients": 2,
        "cache-dir": str(cache_dir),
        "output-dir": str(output_dir),
        "pretrain-epochs": 30,
    }
    deployment = dl.LocalDeployment(options)
    try:
        deployment.start()
        during = deployment.live_pids()
        result = deployment.run(run_config)
    finally:
        deployment.stop()
    assert_all_gone(deployment)
    # SuperLink, its SuperExec, 2 SuperNodes and their SuperExecs were running.
    assert len(during) >= 1 + 2
    assert not options.insecure

    # Secure mode really was used: TLS everywhere and registered SuperNode keys.
    superlink_cmd = deployment.superlink.command
    assert "--enable-supernode-auth" in superlink_cmd and "--ssl-certfile" in superlink_cmd
    assert "--insecure" not in superlink_cmd
    for node in deployment.supernodes:
        assert "--auth-supernode-private-key" in node.command
        assert "--root-certificates" in node.command
    assert len(deployment.node_ids) == 2
    flwr_config = (deployment.flwr_home / "config.toml").read_text()
    assert "root-certificates" in flwr_config and "insecure" not in flwr_config
    assert dl.HOST in deployment.address

    log = result.log_path.read_text()
    assert result.ok, f"run status {result.status}; flwr run log:\n{log[-3000:]}"
    run_dirs = [p.parent for p in output_dir.glob("*/metrics.jsonl")]
    assert len(run_dirs) == 1, f"expected one run directory in {output_dir}: {run_dirs}"
    run_dir = run_dirs[0]
    assert result.run_dir == run_dir
    rows = read_rounds(run_dir)
    assert [row["round"] for row in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= row["test-accuracy-mean"] <= 1.0
        per_client = row["evaluate"]
        assert sorted(per_client) == ["0", "1"]  # keyed by the stable client-id of node_config
        assert all("test-accuracy" in metrics for metrics in per_client.values())
    assert (run_dir / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_supernode_with_unregistered_key_is_refused(options):
    options.num_supernodes = 1
    deployment = dl.LocalDeployment(options)
    try:
        deployment.prepare()
        deployment.start_superlink()
        rogue_key = options.workdir / "rogue" / "rogue_key"
        dl.generate_supernode_key(rogue_key)  # never registered
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
    deployment = dl.LocalDeployment(options)
    with pytest.raises(dl.DeploymentError, match="SuperLink not reachable at 127.0.0.1:"):
        with deployment:
            deployment.prepare()
            deployment.start_superlink()
    assert_all_gone(deployment)


def test_missing_certificates_are_a_clear_error(tmp_path: Path):
    options = dl.DeployOptions(workdir=tmp_path / "work", certs_dir=tmp_path / "nowhere")
    with pytest.raises(dl.DeploymentError, match=r"missing TLS file\(s\) .*ca\.crt"):
        dl.ensure_certificates(options)
    options = dl.DeployOptions(workdir=tmp_path / "work", keys_dir=tmp_path / "nokeys")
    with pytest.raises(dl.DeploymentError, match="missing SuperNode key"):
        dl.ensure_supernode_keys(options)


def test_default_certificates_and_keys_are_generated(tmp_path: Path):
    options = dl.DeployOptions(num_supernodes=2, workdir=tmp_path / "work")
    certs = dl.ensure_certificates(options)
    assert all((certs / name).is_file() for name in dl.CERT_FILES)
    keys = dl.ensure_supernode_keys(options)
    assert [k.name for k in keys] == ["supernode_0", "supernode_1"]
    assert keys[0].with_suffix(".pub").read_text().startswith("ecdsa-sha2-nistp384 ")
    assert (keys[0].stat().st_mode & 0o077) == 0  # private key readable by the owner only


def test_run_config_merging(tmp_path: Path):
    toml_file = tmp_path / "extra.toml"
    toml_file.write_text('method = "fedrep"\nseed = 3\n')
    merged = dl.parse_run_config([str(toml_file), "seed=4 output-dir='out'"])
    assert merged == {"method": "fedrep", "seed": 4, "output-dir": "out"}
    resolved = dl.resolve_run_config(merged, 3, ROOT, base=tmp_path)
    assert resolved["num-clients"] == 3
    assert resolved["output-dir"] == str(tmp_path / "out")
    assert dl.resolve_run_config({}, 2, ROOT)["output-dir"] == str(ROOT / "runs")
    with pytest.raises(dl.RunConfigError, match="unknown run-config key"):
        dl.resolve_run_config({"no-such-key": 1}, 2, ROOT)
    with pytest.raises(dl.RunConfigError, match="differs from --num-supernodes"):
        dl.resolve_run_config({"num-clients": 5}, 2, ROOT)
    with pytest.raises(dl.RunConfigError, match="cannot parse"):
        dl.parse_run_config(["method=fedavg"])  # strings need quotes, as with `flwr run`
