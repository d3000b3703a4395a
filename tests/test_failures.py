"""Failures that are loud, early and recoverable (in process; the launchers are in
test_simulation.py and test_deployment.py).

Damaged checkpoints and client state files, partitions below the minimum, rounds in which every
client fails, the checks before a launch, and the one-line error texts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.records.client_state import ClientStateStore, state_digest
from fedfm_flower.records.durable import DamagedFileError, load_tensors, save_tensors, tensor_sha256
from fedfm_flower.records.results import RunDirectory


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((3, 4), value), "b": torch.arange(5, dtype=torch.int64)}


# ------------------------------------------------------------------ durable tensor files


def test_tensor_files_round_trip_and_leave_no_temporary_files(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    digest = save_tensors(path, _tensors(1.5))
    loaded = load_tensors(path, digest)
    assert digest == tensor_sha256(_tensors(1.5))
    assert all(torch.equal(loaded[k], v) for k, v in _tensors(1.5).items())
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]
    # state_digest is the first 48 bits of the same hash (clients report it as a float metric).
    assert state_digest(loaded) == int(digest[:12], 16) < 2**48


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncate, "not a readable safetensors file"),
        (_flip_last_byte, "differs from"),  # same size, one bit of a value changed
        (lambda p: p.write_bytes(b""), r"not a readable safetensors file \(0 bytes\)"),
        (lambda p: p.unlink(), "no such file"),
    ],
)
def test_a_damaged_tensor_file_is_an_error_naming_the_file(tmp_path, damage, reason) -> None:
    path = tmp_path / "state.safetensors"
    save_tensors(path, _tensors(2.0))
    damage(path)
    with pytest.raises(DamagedFileError, match=reason) as info:
        load_tensors(path)
    assert info.value.path == path
    assert str(path) in str(info.value)


def test_a_digest_kept_elsewhere_must_match(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    save_tensors(path, _tensors(1.0))
    save_tensors(tmp_path / "y.safetensors", _tensors(3.0))
    (tmp_path / "y.safetensors").replace(path)  # an intact file, but not the one recorded
    with pytest.raises(DamagedFileError, match="in its record"):
        load_tensors(path, tensor_sha256(_tensors(1.0)))


# ------------------------------------------------------------------ server checkpoints


def _run_with_checkpoints(tmp_path: Path, rounds: int = 3) -> RunDirectory:
    run = RunDirectory(tmp_path / "run")
    run.checkpoint_dir.mkdir(parents=True)
    for r in range(1, rounds + 1):
        run.save_checkpoint(r, _tensors(float(r)), {"strategy": {"round": r}}, keep=rounds)
    return run


def test_checkpoint_json_commits_a_digest_of_its_tensors(tmp_path: Path) -> None:
    run = _run_with_checkpoints(tmp_path, rounds=1)
    record = json.loads((run.checkpoint_dir / "round_00001.json").read_text())
    assert record["sha256"] == tensor_sha256(_tensors(1.0))
    assert sorted(p.name for p in run.checkpoint_dir.iterdir()) == [
        "round_00001.json",
        "round_00001.safetensors",
    ]


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, caplog) -> None:
    run = _run_with_checkpoints(tmp_path)
    bad = run.checkpoint_dir / "round_00003.safetensors"
    _truncate(bad)
    with caplog.at_level(logging.WARNING):
        server_round, tensors, meta = run.load_newest_checkpoint()
    assert server_round == 2 and meta["strategy"] == {"round": 2}
    assert torch.equal(tensors["a"], _tensors(2.0)["a"])
    assert str(bad) in caplog.text and "round 3 is damaged" in caplog.text


def test_a_swapped_checkpoint_file_fails_its_recorded_digest(tmp_path: Path) -> None:
    run = _run_with_checkpoints(tmp_path)
    newest = run.checkpoint_dir / "round_00003.safetensors"
    (run.checkpoint_dir / "round_00002.safetensors").replace(newest)  # parses, wrong content
    server_round, _, _ = run.load_newest_checkpoint()
    assert server_round == 1  # round 3 fails its digest, round 2's file is gone


def test_no_intact_checkpoint_is_an_error_listing_every_bad_file(tmp_path: Path) -> None:
    run = _run_with_checkpoints(tmp_path, rounds=2)
    for r in (1, 2):
        _truncate(run.checkpoint_dir / f"round_{r:05d}.safetensors")
    with pytest.raises(DamagedFileError, match="no intact checkpoint") as info:
        run.load_newest_checkpoint()
    assert "round_00001.safetensors" in str(info.value)
    assert "round_00002.safetensors" in str(info.value)


# ------------------------------------------------------------------ client state files


def test_client_state_skips_a_damaged_file_for_the_newest_intact_one(tmp_path, caplog) -> None:
    from flwr.app import RecordDict

    writer = ClientStateStore(RecordDict(), 3, "run", str(tmp_path), keep=3)
    for r in (1, 2, 3):
        writer.save(r, _tensors(float(r)))
    bad = writer.directory / "round_00003.safetensors"
    _truncate(bad)
    reader = ClientStateStore(RecordDict(), 3, "run", str(tmp_path), keep=3)  # a restarted node
    with caplog.at_level(logging.WARNING):
        state = reader.load(at_most=3)
    assert reader.loaded_round == 2
    assert torch.equal(state["a"], _tensors(2.0)["a"])
    assert str(bad) in caplog.text
    assert reader.load(before=3) is not None and reader.loaded_round == 2


def test_clients_keep_one_state_more_than_the_server_keeps_checkpoints(small_run_config) -> None:
    from flwr.app import Context, RecordDict

    from client_apps.base import ClientRuntime

    config = ExperimentConfig.from_run_config(
        {**ExperimentConfig().to_run_config(), **small_run_config, "keep-checkpoints": 2}
    )
    context = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": 4},
        state=RecordDict(),
        run_config=config.to_run_config(),
    )
    assert ClientRuntime.from_context(context, "run").store.keep == 3


def test_resume_after_a_crash_and_damaged_newest_files_equals_the_uninterrupted_run(
    small_run_config: dict, tmp_path: Path, caplog
) -> None:
    """The acceptance test of item 3: the ServerApp dies in round 3, then the newest server
    checkpoint (round 2) and the newest client state file are truncated, as a crash mid-write
    or a full disk leaves them. Resume falls back to round 1 and repeats rounds 2 and 3."""
    from safetensors.torch import load_file

    from server_apps.inprocess import ServerCrash, crash_in_round, run_in_process

    base = {
        **small_run_config,
        "method": "pfedseq",
        "num-server-rounds": 3,
        "pfedseq-warmup-rounds": 1,
        "client-state-dir": str(tmp_path / "state"),
        "local-steps": 2,  # the two runs agree whatever the training does
    }
    full, _ = run_in_process({**base, "run-name": "uninterrupted"}, 4)

    with pytest.raises(ServerCrash):
        run_in_process({**base, "run-name": "crashed"}, 4, crash_in_round(3))
    run_dir = Path(base["output-dir"]) / "crashed"
    assert json.loads((run_dir / "failure.json").read_text())["rounds-completed"] == 2
    bad_checkpoint = run_dir / "checkpoints" / "round_00002.safetensors"
    client_dir = tmp_path / "state" / "crashed" / "client_0"
    bad_state = max(client_dir.glob("round_*.safetensors"))
    assert bad_state.name == "round_00003.safetensors"  # trained before the server died
    _truncate(bad_checkpoint)
    _truncate(bad_state)

    with caplog.at_level(logging.WARNING):
        resumed, _ = run_in_process({**base, "run-name": "crashed", "resume": True}, 4)
    assert str(bad_checkpoint) in caplog.text
    assert resumed["final-per-client-accuracy"] == full["final-per-client-accuracy"]
    assert resumed["final-test-accuracy-mean"] == full["final-test-accuracy-mean"]
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    reference = load_file(
        Path(base["output-dir"]) / "uninterrupted/checkpoints/round_00003.safetensors"
    )
    final = load_file(run_dir / "checkpoints" / "round_00003.safetensors")
    assert reference.keys() == final.keys()
    assert all(torch.equal(reference[k], final[k]) for k in reference)
    load_tensors(bad_state)  # the repeated round rewrote the damaged client file intact
    assert not (run_dir / "failure.json").exists()  # cleared by the successful resume


# ------------------------------------------------------------------ partitions


def test_a_partition_below_the_minimum_fails_naming_client_counts_and_knobs() -> None:
    from fedfm_flower.data import (
        PartitionTooSmallError,
        check_client_sizes,
        client_example_counts,
        client_sample_ids,
    )

    # The case of the issue: Dirichlet 0.1 over 8 clients of the feature-skew data, seed 1.
    config = ExperimentConfig(dataset="digits-domains", dirichlet_alpha=0.1, seed=1)
    ids = client_sample_ids(config, 4, 8)
    assert (len(ids.train), len(ids.test)) == (1, 1)  # independent count of client 4's data
    with pytest.raises(PartitionTooSmallError) as info:
        check_client_sizes(config, client_example_counts(config, 8))
    message = str(info.value)
    assert "client 4 of 8 holds 1 training and 1 test examples" in message
    assert "min-train-examples = 10" in message and "min-test-examples = 5" in message
    assert "dirichlet-alpha (now 0.1)" in message and "fewer clients" in message
    # Lowering the minimum is the documented way to accept it; the counts are then reported.
    accepting = config.replace(min_train_examples=1, min_test_examples=1)
    counts = check_client_sizes(accepting, client_example_counts(accepting, 8))
    assert (counts[4].train, counts[4].test) == (1, 1)
    for client, count in enumerate(counts):
        split = client_sample_ids(config, client, 8)
        assert (count.train, count.test, count.val) == tuple(
            len(x) for x in (split.train, split.test, split.val)
        )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_offline_setups_pass_the_default_minimum(seed: int) -> None:
    from fedfm_flower.data import check_client_sizes, client_example_counts

    for setup in (
        ExperimentConfig(seed=seed),  # label skew: Dirichlet 0.3 over 10 clients
        ExperimentConfig(dataset="digits-domains", partitioner="iid", seed=seed),
    ):
        counts = check_client_sizes(setup, client_example_counts(setup, 10))
        assert min(c.test for c in counts) >= setup.min_test_examples


def test_results_report_each_clients_example_counts(small_run_config: dict) -> None:
    from fedfm_flower.data import client_example_counts
    from server_apps.inprocess import run_in_process

    config = {**small_run_config, "method": "fedavg", "num-server-rounds": 1}
    summary, _ = run_in_process(config, 4)
    run_dir = Path(config["output-dir"]) / summary["run-name"]
    saved = json.loads((run_dir / "config.json").read_text())["client-examples"]
    expected = client_example_counts(
        ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **config}), 4
    )
    assert saved == {str(c): e.as_dict() for c, e in enumerate(expected)}
    assert summary["client-examples"] == saved
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    for client, counts in saved.items():  # evaluation ran on exactly the client's test split
        assert record["evaluate"][client]["num-examples"] == counts["test"]


def test_the_serverapp_refuses_a_partition_below_the_minimum(small_run_config: dict) -> None:
    from fedfm_flower.data import PartitionTooSmallError
    from server_apps.inprocess import run_in_process

    config = {**small_run_config, "min-test-examples": 10_000}
    with pytest.raises(PartitionTooSmallError, match="min-test-examples = 10000"):
        run_in_process(config, 4)


# ------------------------------------------------------------------ rounds where every client fails


def _crash_nodes(num_nodes: int, plan: str) -> list[dict]:
    from server_apps.inprocess import simulation_node_configs

    return simulation_node_configs(num_nodes, **{"inject-fault": plan})


def test_a_round_where_every_client_fails_stops_the_run(small_run_config: dict) -> None:
    from server_apps.inprocess import run_in_process
    from server_apps.runner import RunFailed

    config = {
        **small_run_config,
        "method": "fedavg",
        "num-clients": 2,
        "num-server-rounds": 3,
        "run-name": "dead",
    }
    with pytest.raises(RunFailed) as info:
        run_in_process(config, 2, node_configs=_crash_nodes(2, "2:crash"))
    message = str(info.value)
    assert message.startswith("round 2: no client returned a usable training reply")
    assert "clients 0, 1: client error: InjectedCrash: fault injection" in message
    assert "max-failed-rounds = 0" in message and "resume=true run-name='dead'" in message
    run_dir = Path(config["output-dir"]) / "dead"
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2] and "failed" in rounds[1]
    assert RunDirectory(run_dir).checkpoint_rounds() == [1]  # resume repeats round 2
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["error"].startswith("RunFailed: round 2") and "Traceback" in failure["traceback"]
    assert failure["rounds-completed"] == 1 and failure["rounds-failed"] == [2]
    assert not (run_dir / "summary.json").exists()  # no stale "final" accuracy
    # The cause fixed (no more faults), the run resumes at round 2 and completes.
    resumed, _ = run_in_process({**config, "resume": True}, 2)
    assert resumed["rounds"] == 3 and not (run_dir / "failure.json").exists()


def test_failed_rounds_within_the_limit_are_tolerated(small_run_config: dict) -> None:
    from server_apps.inprocess import run_in_process

    config = {
        **small_run_config,
        "method": "fedavg",
        "num-clients": 2,
        "num-server-rounds": 3,
        "max-failed-rounds": 1,
    }
    summary, _ = run_in_process(config, 2, node_configs=_crash_nodes(2, "2:crash"))
    run_dir = Path(config["output-dir"]) / summary["run-name"]
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert ["failed" in r for r in rounds] == [False, True, False]
    assert summary["rounds"] == 3 and summary["final-test-accuracy-mean"] > 0.2


def test_a_last_round_without_evaluation_fails_even_within_the_limit(small_run_config) -> None:
    from server_apps.inprocess import run_in_process
    from server_apps.runner import RunFailed

    def drop_evaluation(client_id, reply):
        return None if reply.metadata.message_type == "evaluate" else reply

    config = {**small_run_config, "method": "fedavg", "num-clients": 2, "max-failed-rounds": 5}
    with pytest.raises(
        RunFailed, match="usable evaluation reply.*the last round has no evaluation"
    ):
        run_in_process(config, 2, drop_evaluation)


def test_round_failure_texts() -> None:
    from server_apps.runner import round_failure

    ok = {"train": {"0": {}}, "rejected": {}, "missing": []}
    assert round_failure(ok) == ""
    assert round_failure({**ok, "evaluate": {"0": {}}}) == ""
    dead = {
        "train": {},
        "rejected": {"0": "NaN", "1": "NaN", "3": "shape"},
        "missing": [2],
        "evaluate": {},
        "evaluate-rejected": {},
        "evaluate-missing": [],
    }
    assert round_failure(dead) == (
        "no client returned a usable training reply (clients 0, 1: NaN; client 3: shape; "
        "no reply from [2]) and no client returned a usable evaluation reply "
        "(no client was sampled)"
    )


# ------------------------------------------------------------------ errors made short


RAY_ERROR = (
    "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()"
    '\x1b[39m (pid=1, ip=1.2.3.4)\n  File "/x/client_apps/app.py", line 74, in train\n'
    "    content = inject_fault(content)\n"
    "client_apps.faults.InjectedCrash: fault injection: boom\n\n"
    "The above exception was the direct cause of the following exception:\n\n"
    "flwr.clientapp.client_app.ClientAppException: \n"
    "Exception ClientAppException occurred. Message: fault injection: boom'>"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (RAY_ERROR, "InjectedCrash: fault injection: boom"),
        ("<class 'client_apps.faults.InjectedCrash'>:<'boom'>", "InjectedCrash: boom"),
        ("Exception ClientAppException occurred. Message: only this'>", "only this"),
        ("plain words", "plain words"),
    ],
)
def test_original_exception(text: str, expected: str) -> None:
    from fedfm_flower.records.tracebacks import original_exception

    assert original_exception(text) == expected


def test_stream_filter_folds_tracebacks_and_debug_shows_them() -> None:
    from fedfm_flower.records.tracebacks import StreamFilter

    stream = [
        "\x1b[92mINFO \x1b[0m:      Starting Flower Simulation",
        "\x1b[91mERROR \x1b[0m:     An exception was raised when processing a message by Ray",
        "\x1b[91mERROR \x1b[0m:     \x1b[36mray::ClientAppActor.run()\x1b[39m (pid=1)",
        '  File "/x/app.py", line 3, in train',
        "client_apps.faults.InjectedCrash: boom",
        "\x1b[91mERROR \x1b[0m:     Traceback (most recent call last):",
        '  File "/x/ray.py", line 9, in get',
        "ray.exceptions.RayTaskError(ClientAppException): ray::ClientAppActor.run()",
        "",
        "\x1b[36m(ClientAppActor pid=1)\x1b[0m inject-fault: corrupting this reply (crash)",
        "WARNING strategies.parts.replies: rejected reply of client 0",
        "Traceback (most recent call last):",
        '  File "/x/runner.py", line 9, in _run',
        "server_apps.runner.RunFailed: round 1: no client returned a usable training reply",
    ]
    shown: list[str] = []
    folded = StreamFilter(shown.append)
    for line in stream:
        folded.feed(line + "\n")
    folded.close()
    assert shown == [
        stream[0],
        stream[1],
        "    [traceback folded] InjectedCrash: boom",
        stream[9],
        stream[10],
        "    [traceback folded] RunFailed: round 1: no client returned a usable training reply",
    ]
    assert folded.folded == 2
    everything: list[str] = []
    debug = StreamFilter(everything.append, debug=True)
    for line in stream:
        debug.feed(line + "\n")
    assert everything == stream


def test_run_status_and_exit_codes() -> None:
    from fedfm_flower.simulation.verdict import (
        ExitCode,
        exit_code_for_status,
        parse_run_status,
        run_id_from_lines,
    )

    reply = json.dumps(
        {
            "runs": [
                {
                    "status": "finished:failed",
                    "status-details": "Simulation failed with exception: round 1: dead",
                }
            ]
        }
    )
    assert parse_run_status(reply) == ("finished:failed", "round 1: dead")
    assert parse_run_status("not json") is None
    assert exit_code_for_status("finished:completed") == ExitCode.COMPLETED == 0
    assert exit_code_for_status("finished:failed") == exit_code_for_status("finished:stopped") == 1
    assert run_id_from_lines(["x", "Successfully started run 42\n"]) == 42
    assert run_id_from_lines(["no run"]) is None


def test_a_lost_digest_key_with_a_changed_value_is_refused_in_own_files(tmp_path: Path) -> None:
    """Found by tests/test_properties_files.py: one bit flipped in the metadata's "sha256" key
    and one in a value read as a pre-digest file, silently another state (client state reads
    only the file's own digest). A file of this package's with metadata but no digest is
    damaged; a foreign file (a user's weights) is still read."""
    path = tmp_path / "state.safetensors"
    save_tensors(path, _tensors(2.0))
    data = bytearray(path.read_bytes())
    data[data.index(b'"sha256"') + 1] ^= 0x01  # "sha256" -> "rha256"
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError, match="metadata without its 'sha256'"):
        load_tensors(path, own=True)
    assert tensor_sha256(load_tensors(path)) != tensor_sha256(_tensors(2.0))  # a foreign file


def test_a_checkpoint_record_with_a_flipped_bit_is_refused_by_its_seal(tmp_path, caplog) -> None:
    """Found by tests/test_properties_files.py: a bit flipped in a key of the JSON record
    ("evaluation-pending" -> "dvaluation-pending") was read as a record without the mark. The
    record is sealed with its own digest: the damaged round is skipped, naming its JSON."""
    run = RunDirectory(tmp_path / "run")
    run.checkpoint_dir.mkdir(parents=True)
    for r in (1, 2):
        meta = {"strategy": {"round": r}, "evaluation-pending": True}
        run.save_checkpoint(r, _tensors(float(r)), meta, keep=2)
    marker = run.checkpoint_dir / "round_00002.json"
    record = marker.read_bytes()
    flipped = bytearray(record)
    flipped[record.index(b'"evaluation-pending"') + 1] ^= 0x01
    marker.write_bytes(bytes(flipped))
    with caplog.at_level(logging.WARNING):
        server_round, _, meta = run.load_newest_checkpoint()
    assert server_round == 1 and meta == {
        "round": 1,
        "sha256": tensor_sha256(_tensors(1.0)),
        "strategy": {"round": 1},
        "evaluation-pending": True,
    }
    assert str(marker) in caplog.text and "content digest" in caplog.text
    # A record written before seals existed is still read; one with a key it never had is not.
    unsealed = {"round": 2, "sha256": tensor_sha256(_tensors(2.0)), "strategy": {"round": 2}}
    marker.write_text(json.dumps(unsealed))
    assert run.load_newest_checkpoint()[2] == unsealed
    marker.write_text(json.dumps({**unsealed, "dvaluation-pending": True}))
    with pytest.raises(DamagedFileError, match="unknown keys"):
        run.load_checkpoint(2)


def test_a_privacy_ledger_with_a_changed_release_is_refused_by_its_seal(tmp_path: Path) -> None:
    """Found by tests/test_properties_files.py: privacy.json with a release round changed
    ("2" -> "12") was read as another ledger; sealed, it is refused naming the file."""
    from fedfm_flower.privacy.ledger import LedgerFile, ReleaseLedger

    LedgerFile(tmp_path).keep(ReleaseLedger("central", [1, 2, 3]))
    path = tmp_path / "privacy.json"
    path.write_text(path.read_text().replace("[1, 2, 3]", "[1, 12, 3]"))
    with pytest.raises(DamagedFileError, match="privacy.json: unusable privacy ledger: content"):
        LedgerFile(tmp_path).read("central")
    path.write_text('{"mode": "central", "noise": "os-entropy", "releases": [1, 2]}')  # unsealed
    assert LedgerFile(tmp_path).read("central").rounds == [1, 2]


def test_a_run_does_not_resume_on_another_foundation_model(small_run_config: dict) -> None:
    """Rounds trained on one frozen backbone do not go on on another (another machine's build
    of the recipe, or a recipe changed since): the resume is refused, naming both models, and
    the run's checkpoints and rounds stay as they were; with the recorded build it goes on."""
    from server_apps.inprocess import ServerCrash, crash_in_round, run_in_process

    base = {**small_run_config, "run-name": "crashed"}
    with pytest.raises(ServerCrash):
        run_in_process(base, 4, crash_in_round(2))
    run_dir = Path(base["output-dir"]) / "crashed"
    payload = json.loads((run_dir / "config.json").read_text())
    card = payload["foundation"]
    assert card["key"] and card["weights-sha256"]  # the offline ViT's build, as loaded
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    for recorded, said in [
        ({"weights-sha256": "0" * 64}, "two builds of foundation"),
        ({"key": "an-older-recipe"}, "two foundation models"),
    ]:
        other = {**payload, "foundation": {**card, **recorded}}
        (run_dir / "config.json").write_text(json.dumps(other))
        with pytest.raises(ValueError, match="cannot resume") as refused:
            run_in_process({**base, "resume": True}, 4)
        assert said in str(refused.value) and card["weights-sha256"][:12] in str(refused.value)
        assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == before
        assert (run_dir / "metrics.jsonl").read_bytes() == metrics
        assert not (run_dir / "summary.json").exists()

    (run_dir / "config.json").write_text(json.dumps(payload))  # the recorded build again
    run_in_process({**base, "resume": True}, 4)
    assert [json.loads(line)["round"] for line in metrics.splitlines()] == [1]
    rounds = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in rounds] == [1, 2]  # went on from round 1
