"""Fault injection on a real loopback deployment (fedfm_flower.deploy, TLS + SuperNode auth).

Each test starts a SuperLink and SuperNodes on 127.0.0.1, breaks something on purpose, and checks
from the run's results and logs that the federation behaved as docs/deployment.md says:

* a SuperNode killed mid-round (SIGKILL of the node and its ClientApp) and restarted as soon as
  the SuperLink lets it back, the other client held in that round until then (`hold`);
* TAP's two rounds and post-FL round, its ServerApp killed after round 1 and the run resumed
  with ``resume=true`` to the uninterrupted in-process run's results;
* malformed training replies of every kind (``inject-fault`` node config), and operator mistakes
  (a node config without ``client-id``, two nodes with the same ``client-id``).

Every test stops every process it started (checked by the deployment's process tag).
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from deploy_support import (
    assert_all_gone,
    assert_secure,
    completed_log,
    hash_files,
    read_rounds,
    rounds_recorded,
)
from safetensors.torch import load_file

from client_apps.faults import FAULT_KINDS, RELEASE_FILE
from fedfm_flower.deploy import DeployOptions, LocalDeployment
from fedfm_flower.records.client_state import state_digest
from fedfm_flower.simulation.verdict import ExitCode

pytestmark = [pytest.mark.slow]


def wait_until(condition: Callable[[], Any], timeout: float, what: str, run: Any = None) -> Any:
    """Poll ``condition`` every 50 ms until it is truthy; fail naming ``what`` after ``timeout``,
    or as soon as ``run`` (the `flwr run` of ``start_run``) has ended without it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if run is not None and not run.alive():
            run.join_output()
            raise AssertionError(f"the run ended before {what}; its output:\n{run.tail(40)}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def base_config(cache_dir: Path, output_dir: Path, **extra: Any) -> dict[str, Any]:
    """A small run of the offline setup."""
    return {
        "cache-dir": str(cache_dir),
        "output-dir": str(output_dir),
        "pretrain-epochs": 30,
        "seed": 0,
        **extra,
    }


def make_options(tmp_path: Path, num_supernodes: int, shared_imports: bool = True) -> Any:
    """Secure (default) deployment options in a private work directory, each node's ClientApp
    tasks in its warm SuperExec (``--warm-executor``), by default forked from one process that
    imported torch and the ClientApp's libraries once (``--shared-imports``: each further
    SuperExec then starts without ~8 s of imports on these 2 cores)."""
    return DeployOptions(
        num_supernodes=num_supernodes,
        workdir=tmp_path / "work",
        startup_timeout=120.0,
        run_timeout=400.0,
        echo=False,
        warm_executor=True,
        shared_imports=shared_imports,
    )


@pytest.mark.timeout(600)
def test_supernode_killed_mid_round_rejoins_with_identical_state(cache_dir, tmp_path):
    # The SuperLink marks the killed node offline after two heartbeat intervals of silence
    # (~20 s here), which answers its round-2 message with an error, and admits the restarted
    # node only then. Client 0 holds its round-2 training until the test releases it, once node
    # 1 is back online (inject-fault "hold"), so round 3 starts with node 1 online: the order is
    # the events', whatever the machine's speed.
    # Each node starts its own SuperExec, as on a real machine: the kill then takes the node's
    # process group, SuperExec and task included, at once (with shared imports the fork server
    # ends the SuperExec when the node's connection closes; the chaos test covers that path).
    options = dataclasses.replace(
        make_options(tmp_path, 2, shared_imports=False), heartbeat_interval=10.0
    )
    round_timeout = 300.0
    config = base_config(
        cache_dir,
        tmp_path / "runs",
        **{
            "method": "pfedseq",
            "pfedseq-warmup-rounds": 1,
            "num-server-rounds": 4,
            "round-timeout": round_timeout,
            "run-name": "node-killed",
        },
    )
    run_dir = tmp_path / "runs" / "node-killed"
    node_dir = options.workdir / "node_1"
    state_file = node_dir / "node-killed" / "client_1" / "round_00001.safetensors"
    release = options.workdir / "node_0" / "node-killed" / "client_0" / RELEASE_FILE
    deployment = LocalDeployment(options)
    try:
        deployment.start(node_overrides={0: {"inject-fault": "2:hold"}})
        ids_before = {n["node-id"] for n in deployment.online_nodes()}
        run = deployment.start_run(config)
        # Round 1 is recorded, so the next task of node 1 is round 2's training.
        wait_until(lambda: rounds_recorded(run_dir) >= 1, 300, "round 1", run)
        assert rounds_recorded(run_dir) == 1, "round 2 ended before round 1 was seen"
        finishing = deployment.tasks_in_flight(1)  # round 1's evaluation may still be ending
        wait_until(
            lambda: deployment.tasks_in_flight(1) - finishing, 60, "node 1's round-2 task", run
        )
        killed = deployment.kill_supernode(1)
        at_kill = hash_files(node_dir)
        state_at_kill = load_file(state_file)
        deployment.restart_supernode(1)  # same key and state-dir: the machine comes back
        deployment.wait_for_supernodes(2)  # the options' startup timeout
        ids_after = {n["node-id"] for n in deployment.online_nodes()}
        assert rounds_recorded(run_dir) == 1, "round 2 ended before client 0 was released"
        release.touch()
        result = deployment.finish_run(run)
        after = hash_files(node_dir)
    finally:
        deployment.stop()
    completed_log(deployment, result)  # the run completed
    assert len(killed) >= 2  # the SuperNode and the SuperExec running its task
    assert ids_after == ids_before  # with SuperNode authentication the node id survives

    rounds = read_rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    # Round 2 completed with client 0 alone when node 1 came back; client 1 is missing (its
    # message went unanswered), not rejected (it did nothing wrong).
    second = rounds[1]
    assert sorted(second["train"]) == ["0"] and second["missing"] == [1]
    assert second["rejected"] == {} and second.get("evaluate-rejected", {}) == {}
    assert second["round-seconds"] < round_timeout
    # Client 1 is back from round 3 on and trains from exactly the state it had saved after
    # round 1, the last round it completed.
    back = [r for r in rounds[2:] if "1" in r["train"]]
    assert [r["round"] for r in back] == [3, 4], [sorted(r["train"]) for r in rounds]
    first_back = back[0]["train"]["1"]
    assert first_back["state-round"] == 1
    assert first_back["state-digest"] == state_digest(state_at_kill)
    assert rounds[2]["train"]["0"]["state-round"] == 2
    # The kill tore nothing: every state file present at the kill is unchanged.
    assert "node-killed/client_1/round_00001.safetensors" in at_kill
    for name, digest in at_kill.items():
        if name in after:
            assert after[name] == digest, f"{name} changed after the kill"
    assert not [name for name in after if name.endswith(".tmp")]


def _checkpoint(run_dir: Path, server_round: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"round_{server_round:05d}.safetensors")


@pytest.mark.timeout(600)
def test_tap_runs_with_its_post_fl_round_and_a_killed_serverapp_resumes_to_the_same_result(
    multitask_run_config, tmp_path
):
    """TAP's 2 rounds and post-FL round on a loopback deployment whose ServerApp is killed after
    round 1 and resumed: the run completes, and its metrics and server state equal, bit for
    bit, those of the uninterrupted run of the same federation in process (the same ClientApp
    and ServerApp code, without the deployment's processes; the reference costs a fifth of a
    deployed run)."""
    # TAP's multi-task federation in small; 3 SuperNodes hold the 3 pair groups, so every
    # component has an owner. The deployment sets num-clients; node configs set state-dir.
    options = make_options(tmp_path, 3)
    unset = ("num-clients", "client-state-dir")
    config = {k: v for k, v in multitask_run_config.items() if k not in unset}
    config.update({"method": "tap", "tap-distill-steps": 2})
    crashed_dir = tmp_path / "runs" / "crashed"
    deployment = LocalDeployment(options)
    try:
        # The reference runs while the deployment starts (mostly `flwr` commands starting up).
        with ThreadPoolExecutor(1) as pool:
            reference = pool.submit(
                deployment.run_in_process, {**config, "run-name": "reference"}, tmp_path / "ref"
            )
            deployment.start()
            reference_dir = reference.result()
        during = deployment.live_pids()
        run = deployment.start_run({**config, "run-name": "crashed"})
        wait_until(
            lambda: (crashed_dir / "checkpoints" / "round_00001.json").exists(),
            300,
            "the round-1 checkpoint",
            run,
        )
        killed = deployment.kill_serverapp()
        # Without a ServerApp the run would end on its own once the SuperLink misses its
        # heartbeats (about a minute); `flwr stop` (finish_run's, at once) ends it now.
        crashed = deployment.finish_run(run, timeout=0)
        resumed = deployment.run({**config, "run-name": "crashed", "resume": True})
    finally:
        deployment.stop()
    assert_all_gone(deployment)
    assert_secure(deployment)
    assert len(during) >= 1 + 3  # the SuperLink and 3 SuperNodes (plus their SuperExecs)

    assert killed, "no ServerApp process was found to kill"
    assert not crashed.ok and crashed.exit_code != ExitCode.COMPLETED
    log = resumed.log_path.read_text()
    assert resumed.ok, log[-3000:]
    assert resumed.exit_code == ExitCode.COMPLETED
    assert "resuming crashed after round 1" in log
    # A node that met `flwr stop` while pulling a message ended that message's task at once: no
    # task waited out its pull patience and no warm SuperExec ended (supernode/superexec docs).
    for node_log in sorted(deployment.logs.glob("supernode_*.log")):
        text = node_log.read_text()
        assert "no object of the message arrived" not in text, node_log.name
        assert "the SuperExec exited" not in text, node_log.name

    # The resumed run is a complete, ordinary secure TAP run: two rounds of stage 1, then the
    # post-FL round in which every client distills X from W~ and is evaluated.
    got = read_rounds(crashed_dir)
    assert [r["round"] for r in got] == [1, 2, 3]  # no round counted twice
    assert [r["phase"] for r in got] == ["train", "train", "post-training"]
    clients = ["0", "1", "2"]
    for record in got[:2]:
        assert sorted(record["train"]) == clients  # keyed by the stable client-id
        for reply in record["train"].values():
            assert any(key.startswith("train-replaced-") for key in reply)
    post = got[2]
    assert sorted(post["train"]) == sorted(post["evaluate"]) == clients
    for reply in post["train"].values():
        assert any(key.startswith("train-distill-") for key in reply)
    assert 0.0 <= post["test-task-score-mean"] <= 1.0
    assert post["bytes-up"] == 0  # the post-FL round sends nothing up
    assert (crashed_dir / "summary.json").is_file()

    rounds = read_rounds(reference_dir)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for want, have in zip(rounds, got, strict=True):
        for phase in ("train", "evaluate"):
            assert sorted(have.get(phase, {})) == sorted(want.get(phase, {})), phase
            for client, metrics in want.get(phase, {}).items():
                for name, value in metrics.items():
                    if name != "train-seconds":
                        assert have[phase][client][name] == value, (phase, client, name)
    final_reference, final_resumed = _checkpoint(reference_dir, 3), _checkpoint(crashed_dir, 3)
    assert final_reference.keys() == final_resumed.keys()
    for name, tensor in final_reference.items():
        assert torch.equal(tensor, final_resumed[name]), name


# Training-reply faults per round: node 0 and node 1 each send a different kind every round from
# round 2 on, so no valid training reply arrives after round 1 and the FedAvg state must stay
# exactly the round-1 state.
FAULTS = {
    0: ["nan", "shape", "missing-key", "client-id", "metric-type", "crash"],
    1: ["inf", "dtype", "extra-key", "oversize", "no-metrics", "torn-pack"],
}
REASONS = {
    "nan": r"contains NaN or Inf",
    "inf": r"contains NaN or Inf",
    "shape": r"has shape \(\d+,\), expected",
    "dtype": r"has dtype float64, expected float32",
    "missing-key": r"missing keys",
    "extra-key": r"unexpected keys \[.*\.extra'\]",
    "client-id": r"reply claims client-id 1 but node belongs to client 0",
    "oversize": r"payload is \d+ bytes, expected",
    "torn-pack": r"pack 'torn': .*lies outside the \d+ bytes",
    "metric-type": r"bad num-examples 12\.5",
    "no-metrics": r"no metrics record",
    "crash": r"client error: .*crashes on purpose",
}


@pytest.mark.timeout(600)
def test_malformed_replies_and_bad_node_configs_leave_server_state_unchanged(cache_dir, tmp_path):
    assert {k for kinds in FAULTS.values() for k in kinds} == set(FAULT_KINDS)
    rounds_total = 1 + len(FAULTS[0])
    options = make_options(tmp_path, 4)
    config = base_config(
        cache_dir,
        tmp_path / "runs",
        **{
            "method": "fedavg",
            "num-server-rounds": rounds_total,
            "eval-every": 100,  # evaluate in the last round only
            "keep-checkpoints": rounds_total,
            "max-failed-rounds": rounds_total - 1,  # rounds 2.. have no usable training reply
            "run-name": "malformed",
        },
    )
    run_dir = tmp_path / "runs" / "malformed"
    deployment = LocalDeployment(options)
    try:
        deployment.prepare()
        deployment.start_superlink()
        deployment.register_keys(range(4))
        plans = {i: ",".join(f"{r}:{k}" for r, k in enumerate(FAULTS[i], start=2)) for i in (0, 1)}
        for i in (0, 1):
            deployment.start_supernode(i, node_config={"inject-fault": plans[i]})
        # Node 2 claims node 0's client id. Whichever of the two answers the identity query first
        # keeps it, so node 2 carries the same fault plan and the expected replies do not depend
        # on that race.
        deployment.start_supernode(2, node_config={"client-id": 0, "inject-fault": plans[0]})
        deployment.start_supernode(3, node_config={"client-id": None, "partition-id": None})
        deployment.wait_for_supernodes(4)
        result = deployment.run(config)
    finally:
        deployment.stop()
    log = completed_log(deployment, result)

    rounds = read_rounds(run_dir)
    assert [r["round"] for r in rounds] == list(range(1, rounds_total + 1))
    assert sorted(rounds[0]["train"]) == ["0", "1"] and rounds[0]["rejected"] == {}
    for record in rounds[1:]:
        index = record["round"] - 2
        assert record["train"] == {}, record["round"]
        assert sorted(record["rejected"]) == ["0", "1"]
        for client in (0, 1):
            kind = FAULTS[client][index]
            reason = record["rejected"][str(client)]
            assert re.search(REASONS[kind], reason), (record["round"], kind, reason)
            assert f"rejected reply of client {client}" in log
    # The server state after every faulty round is bit-identical to the state after round 1.
    first = _checkpoint(run_dir, 1)
    for server_round in range(2, rounds_total + 1):
        later = _checkpoint(run_dir, server_round)
        assert all(torch.equal(first[name], later[name]) for name in first), server_round
    assert sorted(rounds[-1]["evaluate"]) == ["0", "1"]  # the run ended normally

    # Operator mistakes are named in the ServerApp's log; those nodes never got a client slot.
    assert "two nodes claim client-id 0" in log
    assert "node config 'client-id' = None is invalid: missing" in log
    assert all(sorted(r["sampled"]) == [0, 1] for r in rounds)
