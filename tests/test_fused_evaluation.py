"""Fused rounds (``fused-evaluation``): round t's evaluation rides on round t + 1's training
messages, one phase of messages per round, with results bit-identical to the two-phase loop;
crash/resume, failures and client errors in one part of a fused reply."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedfm_flower.records import protocol as P
from fedfm_flower.records.results import RunDirectory, progress_line
from server_apps.inprocess import (
    InProcessGrid,
    ServerCrash,
    crash_in_round,
    run_in_process,
    simulation_node_configs,
)

# Record fields that measure time, or the bytes a fused round saves; everything else must match.
TIMING = {"round-seconds", "server-seconds", "aggregate-seconds", "bytes-down"}
SUMMARY_TIMING = {
    "run-name",
    "total-bytes-down",
    "total-round-seconds",
    "wall-seconds-this-session",
}


@pytest.fixture
def small_run_config(small_run_config: dict) -> dict:
    """The shared small run, with 2 optimizer steps per client and round: these tests compare
    two ways of running the same rounds, which agree whatever the training does."""
    return {**small_run_config, "local-steps": 2}


@pytest.fixture
def phases(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[tuple[str, str, bool]]]]:
    """Every send_and_receive call but the identity queries, as (type, group, carries an
    evaluation) per message."""
    calls: list[list[tuple[str, str, bool]]] = []
    original = InProcessGrid.send_and_receive

    def counting(self, messages, *, timeout=None):  # noqa: ANN001, ANN202
        messages = list(messages)
        if messages and messages[0].metadata.message_type != "query":
            calls.append(
                [
                    (
                        m.metadata.message_type,
                        m.metadata.group_id,
                        P.EVALUATE_ROUND in m.content.config_records[P.CONFIG],
                    )
                    for m in messages
                ]
            )
        return original(self, messages, timeout=timeout)

    monkeypatch.setattr(InProcessGrid, "send_and_receive", counting)
    yield calls


def _records(config: dict, name: str) -> list[dict[str, Any]]:
    return RunDirectory(Path(config["output-dir"]) / name).rounds()


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
    """A round's record without its timings (train-seconds included), downloaded bytes and
    the server's notes on how its step ran."""
    out = {k: v for k, v in record.items() if k not in TIMING}
    out["train"] = {
        c: {k: v for k, v in m.items() if k != P.TRAIN_SECONDS} for c, m in record["train"].items()
    }
    # how the step ran, not what it computed: a resumed pFedSeq run holds no graph from the
    # round before the crash and recomputes that forward pass (the same numbers)
    how = {"pfedseq-forward-held"}
    out["server"] = {
        k: v for k, v in record["server"].items() if not k.endswith("-seconds") and k not in how
    }
    return out


def _assert_same_run(
    config: dict, fused: str, two_phase: str, summaries: tuple, fewer_bytes: bool = True
) -> None:
    """Identical records (evaluation fields included) and summaries, but for time and bytes
    sent (``fewer_bytes``: no more in ``fused``)."""
    a, b = _records(config, fused), _records(config, two_phase)
    assert [r["round"] for r in a] == [r["round"] for r in b]
    for mine, theirs in zip(a, b, strict=True):
        assert ("evaluate" in mine) == ("evaluate" in theirs)
        assert mine.get("evaluate") == theirs.get("evaluate")
        assert _comparable(mine) == _comparable(theirs), mine["round"]
        assert not fewer_bytes or mine["bytes-down"] <= theirs["bytes-down"]  # sent once
    one, other = ({k: v for k, v in s.items() if k not in SUMMARY_TIMING} for s in summaries)
    assert one == other


def _run_both(config: dict, phases: list, nodes: int = 4, **kwargs: Any) -> tuple[dict, dict]:
    """The same experiment fused and in two phases; the fused run's phases are left in
    ``phases``."""
    two_phase, _ = run_in_process(
        {**config, "fused-evaluation": False, "run-name": "two-phase"}, nodes, **kwargs
    )
    phases.clear()
    fused, _ = run_in_process(
        {**config, "fused-evaluation": True, "run-name": "fused"}, nodes, **kwargs
    )
    return fused, two_phase


@pytest.mark.parametrize(
    "setting",
    [
        {"method": "fedavg"},
        {"method": "fedrep"},
        {"method": "pfedseq", "pfedseq-warmup-rounds": 1},
        {"method": "fedavg-ft", "fraction-train": 0.5, "finetune-steps": 2},
    ],
    ids=["fedavg", "fedrep", "pfedseq", "fedavg-ft-partial"],
)
def test_fused_rounds_give_the_two_phase_results_in_one_phase_per_round(
    small_run_config: dict, tmp_path: Path, phases: list, setting: dict
) -> None:
    config = {
        **small_run_config,
        **setting,
        "num-server-rounds": 3,
        "client-state-dir": str(tmp_path / "state"),
    }
    fused, two_phase = _run_both(config, phases)
    _assert_same_run(config, "fused", "two-phase", (fused, two_phase))
    # One phase per round, plus the last round's evaluation.
    assert len(phases) == 3 + 1
    assert all(t == "train" for t, _, _ in phases[0])  # round 1: nothing to evaluate yet
    for server_round, phase in enumerate(phases[1:3], start=2):
        trained = [(t, g, carries) for t, g, carries in phase if t == "train"]
        alone = [(t, g) for t, g, _ in phase if t == "evaluate"]
        assert {g for _, g, _ in trained} == {str(server_round)}
        assert all(carries for _, _, carries in trained)  # every client evaluates each round
        assert {g for _, g in alone} <= {str(server_round - 1)}
        assert len(trained) + len(alone) == 4  # one message per client
        if setting.get("fraction-train", 1.0) < 1:
            assert len(trained) == 2 and len(alone) == 2
    assert [t for t, _, _ in phases[3]] == ["evaluate"] * 4  # the final evaluation


def test_a_client_whose_training_crashes_still_delivers_its_evaluation(
    small_run_config: dict, phases: list
) -> None:
    nodes = simulation_node_configs(4)
    nodes[2]["inject-fault"] = "2:crash"  # client 2's ClientApp raises after training round 2
    config = {**small_run_config, "method": "fedavg", "num-server-rounds": 3}
    fused, two_phase = _run_both(config, phases, node_configs=nodes)
    _assert_same_run(config, "fused", "two-phase", (fused, two_phase))
    records = _records(config, "fused")
    assert records[1]["rejected"] == {"2": "client error: InjectedCrash: " + _CRASH}
    assert set(records[0]["evaluate"]) == {"0", "1", "2", "3"}  # came with round 2's replies


_CRASH = "fault injection: this ClientApp crashes on purpose"


@pytest.mark.parametrize("resume_fused", [True, False])
def test_a_crash_before_the_next_round_replies_loses_no_evaluation(
    small_run_config: dict, tmp_path: Path, resume_fused: bool
) -> None:
    base = {
        **small_run_config,
        "method": "pfedseq",
        "pfedseq-warmup-rounds": 1,
        "num-server-rounds": 3,
        "client-state-dir": str(tmp_path / "state"),
    }
    full, _ = run_in_process({**base, "run-name": "uninterrupted"}, 4)
    with pytest.raises(ServerCrash):  # dies when round 3's replies (with round 2's evaluation) come
        run_in_process({**base, "run-name": "crashed"}, 4, crash_in_round(3))
    run = RunDirectory(Path(base["output-dir"]) / "crashed")
    written = run.rounds()
    assert [r["round"] for r in written] == [1, 2]
    assert "evaluate" in written[0] and "evaluate" not in written[1]  # round 2's is pending
    assert run.load_checkpoint(2)[1]["evaluation-pending"] is True
    assert run.load_checkpoint(1)[1]["evaluation-pending"] is True
    resumed, _ = run_in_process(
        {**base, "run-name": "crashed", "resume": True, "fused-evaluation": resume_fused}, 4
    )
    _assert_same_run(base, "crashed", "uninterrupted", (resumed, full), fewer_bytes=False)


def test_an_evaluation_that_fails_one_round_later_stops_the_run_and_resume_repeats_it(
    small_run_config: dict, tmp_path: Path
) -> None:
    from server_apps.runner import RunFailed

    def drop_carried_evaluations(client_id, reply):  # noqa: ANN001, ANN202
        if reply.metadata.group_id == "2" and P.EVALUATE_METRICS in reply.content:
            del reply.content[P.EVALUATE_METRICS]
        return reply

    base = {
        **small_run_config,
        "method": "fedrep",
        "num-server-rounds": 3,
        "client-state-dir": str(tmp_path / "state"),  # the heads the repeated evaluation needs
    }
    full, _ = run_in_process({**base, "run-name": "uninterrupted"}, 4)
    with pytest.raises(RunFailed, match=r"^round 1: no client returned a usable evaluation"):
        run_in_process({**base, "run-name": "dead"}, 4, drop_carried_evaluations)
    run = RunDirectory(Path(base["output-dir"]) / "dead")
    written = run.rounds()
    assert [r["round"] for r in written] == [1] and written[0]["evaluate"] == {}
    assert written[0]["evaluate-rejected"]["0"] == "no metrics record"
    assert "failed" in written[0] and run.checkpoint_rounds() == [1]
    resumed, _ = run_in_process({**base, "run-name": "dead", "resume": True}, 4)
    _assert_same_run(base, "dead", "uninterrupted", (resumed, full))
    assert not (run.path / "failure.json").exists()


def test_an_evaluation_failure_within_the_limit_is_recorded_like_the_two_phase_one(
    small_run_config: dict, phases: list
) -> None:
    def drop_round_1_evaluations(client_id, reply):  # noqa: ANN001, ANN202
        if P.EVALUATE_METRICS in reply.content and reply.metadata.group_id == "2":
            del reply.content[P.EVALUATE_METRICS]  # fused: round 1's evaluation comes in round 2
        if reply.metadata.message_type == "evaluate" and reply.metadata.group_id == "1":
            return None  # two-phase: round 1's evaluate replies
        return reply

    config = {
        **small_run_config,
        "method": "fedavg",
        "num-server-rounds": 3,
        "max-failed-rounds": 1,
    }
    fused, two_phase = _run_both(config, phases, reply_hook=drop_round_1_evaluations)
    for name in ("fused", "two-phase"):
        records = _records(config, name)
        assert ["failed" in r for r in records] == [True, False, False]
        assert records[0]["evaluate"] == {}
    assert fused["final-per-client-accuracy"] == two_phase["final-per-client-accuracy"]


def test_eval_every_and_a_strategy_that_opts_out(
    small_run_config: dict, phases: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    from strategies.fedavg import FedAvgStrategy

    config = {**small_run_config, "method": "fedavg", "num-server-rounds": 4, "eval-every": 2}
    fused, two_phase = _run_both(config, phases)
    _assert_same_run(config, "fused", "two-phase", (fused, two_phase))
    # Rounds 1-4, round 2's evaluation on round 3's messages, the last round's on its own.
    assert len(phases) == 5
    assert [any(c for _, _, c in phase) for phase in phases] == [False, False, True, False, False]

    monkeypatch.setattr(FedAvgStrategy, "fused_evaluation", False)
    phases.clear()
    run_in_process({**config, "run-name": "opted-out"}, 4)
    assert len(phases) == 4 + 2  # two phases in each evaluated round
    assert not any(c for phase in phases for _, _, c in phase)


def test_which_strategies_fuse(small_run_config: dict) -> None:
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.methods.registry import METHODS
    from server_apps.runner import build_strategy
    from strategies.fedavg import FedAvgStrategy

    for method in ("fedavg", "fedrep", "pfedseq", "pfedpg", "centralized", "apfl", "per-fedavg"):
        config = ExperimentConfig.from_run_config(
            {**ExperimentConfig().to_run_config(), **small_run_config, "method": method}
        )
        assert build_strategy(config).fuses_evaluation(), method
    assert "feddpa-f" in METHODS and "tap" in METHODS  # their payloads are FedAvg's

    class OwnPayload(FedAvgStrategy):
        def evaluate_payload(self, client_id: int, server_round: int) -> dict:
            return {}

    config = ExperimentConfig.from_run_config(
        {**ExperimentConfig().to_run_config(), **small_run_config, "method": "fedavg"}
    )
    from fedfm_flower.models import initial_trainable

    assert not OwnPayload(config, initial_trainable(config, "lora", 10)).fuses_evaluation()


def test_the_progress_line_names_the_round_of_an_earlier_evaluation() -> None:
    earlier = {"round": 2, "test-accuracy-mean": 0.5, "test-accuracy-std": 0.1}
    record = {
        "round": 3,
        "clients-reported": 4,
        "clients-sampled": 4,
        "bytes-down": 10,
        "bytes-up": 10,
        "round-seconds": 1.0,
        "train-loss-mean": 0.3,
    }
    line = progress_line(record, 5, 2.0, "accuracy", earlier)
    assert line.startswith("[round   3/5] acc@2 0.5000 ± 0.1000 |")
    assert "acc    n/a" in progress_line(record, 5, 2.0)


def test_feddpa_f_post_training_round_carries_the_last_federated_evaluation(
    small_run_config: dict, tmp_path: Path, phases: list
) -> None:
    from test_feddpa import LANGUAGE

    config = {
        **small_run_config,
        **LANGUAGE,
        "method": "feddpa-f",
        "num-clients": 2,
        "local-steps": 2,
        "fraction-train": 0.5,
        "client-state-dir": str(tmp_path / "state"),
    }
    fused, two_phase = _run_both(config, phases, nodes=2)
    _assert_same_run(config, "fused", "two-phase", (fused, two_phase))
    # Rounds 1, 2 and the post-training round 3 (round 2's evaluation on it), then round 3's.
    assert len(phases) == 4
    assert all(c for t, _, c in phases[2] if t == "train") and len(phases[2]) == 2
