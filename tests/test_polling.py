"""The ServerApp's PromptGrid: push, then pull with short pauses, on a fake clock; the whole run
through it is the in-process run, bit for bit."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

from server_apps.polling import MAX_PAUSE_S, pauses, push_and_pull


class Clock:
    """A fake clock that advances only when slept on."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class SlowGrid:
    """A grid whose reply to message ``i`` reaches the server at ``arrival[i]`` seconds."""

    def __init__(self, clock: Clock, arrival: dict[str, float]) -> None:
        self.clock, self.arrival, self.pulls = clock, arrival, 0

    def push_messages(self, messages: Iterable[str]) -> list[str]:
        return list(messages)

    def pull_messages(self, ids: Iterable[str]) -> list[SimpleNamespace]:
        self.pulls += 1
        ready = [i for i in ids if self.arrival[i] <= self.clock.now]
        for i in ready:
            self.arrival[i] = float("inf")  # a reply is delivered once
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in ready]


def _replied(replies: list[SimpleNamespace]) -> list[str]:
    return sorted(r.metadata.reply_to_message_id for r in replies)


def test_pauses_grow_to_the_cap() -> None:
    sequence = [p for p, _ in zip(pauses(), range(12), strict=False)]
    assert sequence[0] == 0.01 and sequence[1] == 0.015
    assert all(b >= a for a, b in zip(sequence, sequence[1:], strict=False))
    assert max(sequence) == sequence[-1] == MAX_PAUSE_S


def test_every_reply_is_seen_within_a_pause_of_its_arrival() -> None:
    clock = Clock()
    grid = SlowGrid(clock, {"a": 0.0, "b": 0.5, "c": 2.35})
    replies = push_and_pull(grid, ["a", "b", "c"], 60.0, clock=clock, sleep=clock.sleep)
    assert _replied(replies) == ["a", "b", "c"]
    # Flower's HttpGrid would return at 3.0 s (a pull, 3 s of sleep, a pull).
    assert 2.35 <= clock.now <= 2.35 + MAX_PAUSE_S
    assert max(clock.sleeps) <= MAX_PAUSE_S


def test_a_pull_that_brings_replies_starts_the_pauses_over() -> None:
    # Replies one after another, as from clients sharing the cores: after a long first wait
    # the pauses have grown to the cap, but each reply brings them back to the first pause,
    # so the last reply is seen within a couple of short pauses.
    clock = Clock()
    arrival = {"a": 1.0, "b": 1.03, "c": 1.06}
    grid = SlowGrid(clock, dict(arrival))
    replies = push_and_pull(grid, list(arrival), None, clock=clock, sleep=clock.sleep)
    assert _replied(replies) == ["a", "b", "c"]
    assert clock.now <= 1.06 + 0.01 + 0.015 + 0.0225
    assert clock.now < 1.06 + MAX_PAUSE_S / 2
    assert max(clock.sleeps) == MAX_PAUSE_S and clock.sleeps[-1] < MAX_PAUSE_S / 2


def test_the_timeout_ends_the_wait_with_the_replies_so_far() -> None:
    clock = Clock()
    grid = SlowGrid(clock, {"a": 0.2, "b": 100.0})
    replies = push_and_pull(grid, ["a", "b"], 5.0, clock=clock, sleep=clock.sleep)
    assert _replied(replies) == ["a"]
    assert clock.now == 5.0  # the last pause is cut to the deadline, then one last pull
    assert grid.pulls == len(clock.sleeps) + 1


def test_replies_ready_at_once_need_one_pull_and_no_sleep() -> None:
    clock = Clock()
    grid = SlowGrid(clock, {"a": 0.0, "b": 0.0})
    assert _replied(push_and_pull(grid, ["a", "b"], None, clock=clock, sleep=clock.sleep)) == [
        "a",
        "b",
    ]
    assert grid.pulls == 1 and clock.sleeps == []


def test_the_server_app_runs_through_a_prompt_grid_to_the_same_records(
    small_run_config: dict, monkeypatch
) -> None:
    """``server_apps.app.main`` wraps the grid it is given in a PromptGrid: every exchange goes
    through ``push_and_pull``, and the records are those of the unwrapped in-process run."""
    from flwr.app import Context, RecordDict

    from client_apps.app import app as client_app
    from fedfm_flower.config.experiment import ExperimentConfig
    from server_apps import polling
    from server_apps.app import main
    from server_apps.inprocess import InProcessGrid, run_in_process, simulation_node_configs

    exchanges: list[float | None] = []
    original = polling.push_and_pull

    def counting(grid, messages, timeout, **kwargs):  # noqa: ANN001, ANN003, ANN202
        exchanges.append(timeout)
        return original(grid, messages, timeout, **kwargs)

    monkeypatch.setattr(polling, "push_and_pull", counting)
    config = {**small_run_config, "method": "fedavg"}
    run_in_process({**config, "run-name": "plain"}, 4)
    assert exchanges == []  # the in-process grid alone does not poll
    full = {**ExperimentConfig().to_run_config(), **config, "run-name": "served"}
    grid = InProcessGrid(client_app, full, simulation_node_configs(4), None)
    main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=full))
    rounds = config["num-server-rounds"]
    round_timeout = ExperimentConfig.from_run_config(full).round_timeout
    # One phase per round (evaluation fused into the next round), and the last evaluation.
    assert exchanges.count(round_timeout) == rounds + 1

    def records(name: str) -> list[dict]:
        lines = (Path(config["output-dir"]) / name / "metrics.jsonl").read_text().splitlines()
        out = []
        for record in map(json.loads, lines):
            for phase in ("train", "evaluate"):
                for metrics in record.get(phase, {}).values():
                    metrics.pop("train-seconds", None)
            out.append({k: record.get(k) for k in ("round", "train", "evaluate")})
        return out

    assert records("served") == records("plain")
    # prompt-replies = false hands the ServerApp Flower's grid as it is.
    exchanges.clear()
    full = {**full, "run-name": "flower", "prompt-replies": False}
    grid = InProcessGrid(client_app, full, simulation_node_configs(4), None)
    main(grid, Context(run_id=2, node_id=0, node_config={}, state=RecordDict(), run_config=full))
    assert exchanges == [] and records("flower") == records("plain")
