"""The chaos harness (fedfm_flower.deploy.chaos): its plans, its checks, the stalled state write,
and a short chaos run on a loopback deployment (the long one is the module's command)."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict

from client_apps.faults import InjectedCrash, parse_faults, stall_state_write
from fedfm_flower.deploy.chaos import (
    ChaosEvent,
    check_chaos,
    check_plan,
    plan_chaos,
    stall_overrides,
)
from fedfm_flower.records.client_state import ClientStateStore, state_digest
from fedfm_flower.records.durable import save_tensors
from fedfm_flower.records.results import RunDirectory


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {"head.weight": torch.full((3, 4), value), "head.bias": torch.full((3,), value)}


# ------------------------------------------------------------------ plans


def test_a_plan_is_seeded_spaced_and_spares_the_nodes_it_is_told_to() -> None:
    plan = plan_chaos(7, rounds=20, num_nodes=4, node_kills=3, write_kills=2, serverapp_kills=2)
    assert plan == plan_chaos(7, 20, 4, 3, 2, 2)
    assert plan != plan_chaos(8, 20, 4, 3, 2, 2)
    kinds = [e.kind for e in plan]
    assert kinds.count("node-mid-training") == 3 and kinds.count("node-mid-write") == 2
    assert kinds.count("serverapp") == 2
    rounds = [e.round for e in plan]
    assert len(set(rounds)) == len(rounds) and all(2 <= r <= 16 for r in rounds)
    for node in {e.node for e in plan} - {None}:
        mine = sorted(e.round for e in plan if e.node == node)
        assert node != 0 and all(b - a >= 4 for a, b in zip(mine, mine[1:], strict=False))
    writes: dict[int, list[str]] = {}
    for event in plan:
        if event.kind == "node-mid-write":
            writes.setdefault(event.node, []).append(f"{event.round}:stall-save")
    assert writes and stall_overrides(plan) == {
        node: {"inject-fault": ",".join(items)} for node, items in writes.items()
    }


def test_a_plan_may_restart_the_superlink_never_in_a_round_of_another_server_fault() -> None:
    plan = plan_chaos(3, 20, 4, 1, 0, 1, superlink_restarts=2)
    assert [e.kind for e in plan].count("superlink") == 2
    assert all(e.node is None for e in plan if e.kind == "superlink")
    assert not any(e.kind == "superlink" for e in plan_chaos(3, 20, 4, 1, 0, 1))
    with pytest.raises(ValueError, match="two ServerApp kills or SuperLink restarts in one"):
        check_plan(
            [ChaosEvent("serverapp", 4), ChaosEvent("superlink", 4)],
            rounds=10,
            num_nodes=3,
            rejoin=3,
        )


def test_a_superlink_with_its_state_in_memory_is_not_restarted(tmp_path: Path) -> None:
    from fedfm_flower.deploy import DeployOptions, LocalDeployment
    from fedfm_flower.deploy.options import IN_MEMORY, DeploymentError

    deployment = LocalDeployment(DeployOptions(workdir=tmp_path, superlink_database=IN_MEMORY))
    with pytest.raises(DeploymentError, match="no SuperLink to restart"):
        deployment.restart_superlink()
    deployment.superlink = object()  # type: ignore[assignment]  # started, as far as it knows
    with pytest.raises(DeploymentError, match="forgets its nodes and runs"):
        deployment.restart_superlink()


def test_stall_overrides_parse_as_the_nodes_fault_plan() -> None:
    plan = [ChaosEvent("node-mid-write", 3, 1), ChaosEvent("node-mid-write", 9, 1)]
    overrides = stall_overrides(plan)
    assert parse_faults(overrides[1], environ={}) == {3: "stall-save", 9: "stall-save"}


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (ChaosEvent("reboot", 3, 1), "kind must be one of"),
        (ChaosEvent("node-mid-training", 1, 1), r"round must be in 2\.\.9"),
        (ChaosEvent("node-mid-training", 10, 1), r"round must be in 2\.\.9"),
        (ChaosEvent("node-mid-write", 3, 5), r"node must be in 0\.\.2"),
        (ChaosEvent("serverapp", 3, 1), "names no node"),
        (ChaosEvent("superlink", 3, 0), "names no node"),
    ],
)
def test_a_plan_the_driver_cannot_carry_out_is_refused_naming_the_event(event, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_plan([event], rounds=10, num_nodes=3, rejoin=3)


def test_a_node_killed_again_before_it_can_be_back_is_refused() -> None:
    plan = [ChaosEvent("node-mid-training", 3, 1), ChaosEvent("node-mid-write", 5, 1)]
    with pytest.raises(ValueError, match="node 1 was killed in round 3"):
        check_plan(plan, rounds=10, num_nodes=3, rejoin=3)
    check_plan(plan, rounds=10, num_nodes=3, rejoin=2)
    with pytest.raises(ValueError, match="cannot fit 9 events"):
        plan_chaos(0, rounds=10, num_nodes=3, node_kills=9, write_kills=0, serverapp_kills=0)


# ------------------------------------------------------------------ the stalled write


def test_a_stalled_state_write_leaves_half_a_temporary_file_and_the_old_state_intact(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ClientStateStore(RecordDict(), 1, "run", str(tmp_path), keep=5)
    store.save(1, _tensors(1.0))
    stall_state_write(store, seconds=30.0)
    # Heard on the module's own logger: configure_logging stops our loggers propagating.
    faults_log = logging.getLogger("client_apps.faults")
    monkeypatch.setattr(faults_log, "level", logging.WARNING)
    monkeypatch.setattr(faults_log, "handlers", [caplog.handler])

    def stalled_save() -> None:  # nobody kills it: it fails in 30 s, after the test, quietly
        with contextlib.suppress(InjectedCrash):
            store.save(2, _tensors(2.0))

    writer = threading.Thread(target=stalled_save, daemon=True)
    writer.start()
    # The stall is announced once the half file is in place (written in full, then truncated).
    deadline = time.monotonic() + 60
    while "stalls half-way" not in caplog.text:
        assert writer.is_alive(), "the stalled write ended without stalling"
        assert time.monotonic() < deadline, "the write did not announce its stall within 60 s"
        time.sleep(0.01)
    temp = list(store.directory.glob(".round_00002.safetensors.*.tmp"))
    assert len(temp) == 1, "the stalled write left no temporary file"
    full = tmp_path / "full.safetensors"
    save_tensors(full, {k: v.contiguous() for k, v in _tensors(2.0).items()})
    assert 0 < temp[0].stat().st_size < full.stat().st_size
    # What a node killed now leaves: round 1 intact and found, round 2 absent.
    restarted = ClientStateStore(RecordDict(), 1, "run", str(tmp_path), keep=5)
    assert restarted.rounds() == [1]
    assert torch.equal(restarted.load(before=3)["head.bias"], _tensors(1.0)["head.bias"])
    # The next save of a later round removes the leftover of the interrupted one.
    restarted.save(3, _tensors(3.0))
    assert not list(store.directory.glob("*.tmp"))
    assert restarted.rounds() == [1, 3]


def test_a_stall_nobody_kills_fails_the_write_without_committing_it(tmp_path: Path) -> None:
    store = ClientStateStore(RecordDict(), 1, "run", str(tmp_path))
    stall_state_write(store, seconds=0.05)
    with pytest.raises(InjectedCrash, match="round_00002.safetensors was not killed"):
        store.save(2, _tensors(2.0))
    assert not list(store.directory.glob("*.tmp"))
    assert not (store.directory / "round_00002.safetensors").exists()
    # once per file: the replay of the round (after a restart) writes normally
    again = ClientStateStore(RecordDict(), 1, "run", str(tmp_path))
    stall_state_write(again, seconds=30.0)
    again.save(2, _tensors(2.0))
    assert again.rounds() == [2]


# ------------------------------------------------------------------ checks


def _write_run(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _reply(start: int, digest: int, loss: float) -> dict:
    return {"state-round": start, "state-digest": digest, "train-loss": loss, "train-seconds": 1.0}


def test_check_chaos_passes_a_consistent_run_and_names_each_kind_of_damage(tmp_path) -> None:
    states = {0: tmp_path / "s0", 1: tmp_path / "s1"}
    digests = {}
    for client, directory in states.items():
        for r in (1, 2, 3):
            save_tensors(directory / f"round_{r:05d}.safetensors", _tensors(10 * client + r))
            digests[client, r] = state_digest(_tensors(10 * client + r))
    evaluate = {"0": {"accuracy": 0.5}, "1": {"accuracy": 0.6}}
    records = [
        {"round": 1, "train": {"0": _reply(0, 0, 1.0), "1": _reply(0, 0, 2.0)}},
        # client 1 killed in round 2: missing; it resumes from its round-1 state in round 3
        {"round": 2, "train": {"0": _reply(1, digests[0, 1], 0.9)}},
        {
            "round": 3,
            "train": {"0": _reply(2, digests[0, 2], 0.8), "1": _reply(1, digests[1, 1], 1.5)},
            "evaluate": evaluate,
        },
    ]
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    _write_run(run_dir, records)
    uninterrupted = json.loads(json.dumps(records))
    uninterrupted[1]["train"]["1"] = _reply(1, digests[1, 1], 1.9)
    uninterrupted[2]["train"]["1"] = _reply(2, digests[1, 2], 1.4)
    for r in uninterrupted:
        for reply in r["train"].values():
            reply["train-seconds"] = 7.0  # timings never count
    _write_run(reference, uninterrupted)
    assert check_chaos(run_dir, states, 3, killed={1}, reference_dir=reference) == []

    # client 0, never killed, differs from the reference
    changed = json.loads(json.dumps(uninterrupted))
    changed[2]["train"]["0"]["train-loss"] = 0.7
    _write_run(reference, changed)
    assert check_chaos(run_dir, states, 3, killed={1}, reference_dir=reference) == [
        "round 3 train: client 0 differs from the uninterrupted run in train-loss"
    ]
    # a round recorded twice, a torn state file, a leftover, a reply from the wrong state
    _write_run(run_dir, [*records[:2], records[1], records[2]])
    (states[1] / "round_00001.safetensors").write_bytes(b"torn")
    (states[0] / ".round_00004.safetensors.abc.tmp").write_bytes(b"half")
    problems = check_chaos(run_dir, states, 3, killed={1})
    assert problems[0] == "rounds recorded [1, 2, 2, 3], expected 1..3 once each"
    assert any(p.startswith("temporary file left:") for p in problems)
    assert any(p.startswith("damaged file:") and "round_00001" in p for p in problems)
    assert any("client 1 round 3: the state it started from" in p for p in problems)
    assert any(
        "client 0 round 2: started from its round-1 state, expected one of rounds 2..1" in p
        for p in problems
    )


def test_a_leftover_of_a_kill_mid_write_is_expected_until_the_client_saves_a_later_round(
    tmp_path: Path,
) -> None:
    states = {1: tmp_path / "s1"}
    save_tensors(states[1] / "round_00001.safetensors", _tensors(1.0))
    leftover = states[1] / ".round_00002.safetensors.x1y2.tmp"
    leftover.write_bytes(b"half")
    run_dir = tmp_path / "run"
    _write_run(run_dir, [{"round": 1, "train": {"1": _reply(0, 0, 1.0)}}])
    assert check_chaos(run_dir, states, 1, killed={1}, stalled={(1, 2)}) == []
    assert check_chaos(run_dir, states, 1, killed={1}) == [f"temporary file left: {leftover}"]
    save_tensors(states[1] / "round_00003.safetensors", _tensors(3.0))  # not cleaned: a bug
    assert check_chaos(run_dir, states, 1, killed={1}, stalled={(1, 2)}) == [
        f"temporary file left: {leftover}"
    ]


# ------------------------------------------------------------------ a deployed chaos run


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_chaos_run_loses_nothing_and_spared_clients_match_the_uninterrupted_run(
    cache_dir, tmp_path
):
    """3 SuperNodes, 6 rounds of Local: node 2 SIGKILLed mid-training and node 1 mid-write in
    round 2, both restarted; the ServerApp SIGKILLed after round 4 and the run resumed. The
    SuperExecs are forked from one process (``shared_imports``, the chaos command's
    ``--shared-imports`` for many nodes on one machine), so a killed node's SuperExec ends when
    the fork server sees its node go."""
    from deploy_support import assert_all_gone

    from fedfm_flower.deploy import DeployOptions, LocalDeployment
    from fedfm_flower.deploy.chaos import (
        ChaosDriver,
        chaos_run_config,
        client_state_dirs,
        killed_clients,
        stalled_clients,
    )

    rounds = 6
    plan = [
        ChaosEvent("node-mid-write", 2, 1),
        ChaosEvent("node-mid-training", 2, 2),
        ChaosEvent("serverapp", 4),
    ]
    check_plan(plan, rounds, 3, rejoin=2)
    options = DeployOptions(
        num_supernodes=3,
        workdir=tmp_path / "work",
        startup_timeout=120.0,
        echo=False,
        warm_executor=True,
        shared_imports=True,
        heartbeat_interval=10.0,  # a killed node is offline, and can come back, after ~20 s
    )
    config = chaos_run_config(
        {
            "method": "local",
            "cache-dir": str(cache_dir),
            "output-dir": str(tmp_path / "runs"),
            "pretrain-epochs": 30,
            "seed": 0,
            "run-name": "chaos",
            "round-timeout": 40.0,  # the first round's cold start fits in it
        },
        rounds,
    )
    deployment = LocalDeployment(options)
    try:
        # The reference runs while the deployment starts (mostly `flwr` commands starting up).
        with ThreadPoolExecutor(1) as pool:
            uninterrupted = pool.submit(deployment.run_in_process, config, tmp_path / "reference")
            deployment.start(stall_overrides(plan))
            reference = uninterrupted.result()
        driver = ChaosDriver(deployment, config, tmp_path / "runs" / "chaos", timeout=480.0)
        results = driver.run(plan)
    finally:
        deployment.stop()
    assert_all_gone(deployment)

    assert [r.event for r in driver.records] == sorted(plan, key=lambda e: (e.round, e.kind))
    assert all(not r.skipped and r.pids for r in driver.records)
    assert [r.restart_seconds is not None for r in driver.records] == [True, True, False]
    assert [r.status for r in results[:-1]] == ["serverapp-killed"] and results[-1].ok
    states = client_state_dirs(deployment, "chaos")
    problems = check_chaos(
        driver.run_dir,
        states,
        rounds,
        killed_clients(deployment, plan),
        stalled_clients(deployment, plan),
        results[-1],
        reference,
    )
    assert problems == []
    records = RunDirectory(driver.run_dir).rounds()
    # The kills took effect (clients 1 and 2 missing in round 2), and client 0, never killed,
    # took part in every later round, so check_chaos compared all of them with the reference.
    assert {"1", "2"}.isdisjoint(records[1]["train"])
    assert all("0" in r["train"] for r in records[1:])
    assert (states[1] / ".stalled-round_00002.safetensors").exists()
    # Both killed nodes came back and trained on from their round-1 state, the newest complete
    # one (node 1's round-2 write was cut half-way; its leftover is gone after its next save).
    for client in ("1", "2"):
        back = [r for r in records[2:] if client in r["train"]]
        assert back and back[0]["train"][client]["state-round"] == 1, client


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "5"], "no room for 8 events in 5 rounds of 4 nodes"),
        (["--set", "lr=-1"], "run config 'lr' = -1.0 is invalid"),
        (["--set", "partitioner=nonsense"], "'partitioner' = 'nonsense' is invalid: allowed: iid"),
        (["--heartbeat-interval", "2"], "--heartbeat-interval: heartbeat interval must be"),
    ],
)
def test_the_chaos_command_refuses_bad_input_before_starting_anything(
    argv, message, tmp_path, capsys
) -> None:
    from fedfm_flower.deploy.chaos import main

    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path / "chaos")])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "chaos").exists()
