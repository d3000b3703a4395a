"""Per-round client state in memory and on disk: lookups, pruning, persistence, atomicity."""

from __future__ import annotations

from pathlib import Path

import torch
from flwr.app import RecordDict

from fedfm_flower.records.client_state import ClientStateStore


def tensors(value: float) -> dict[str, torch.Tensor]:
    return {"head.weight": torch.full((2, 3), value), "head.bias": torch.full((2,), value)}


def test_lookups_before_and_at_most() -> None:
    store = ClientStateStore(RecordDict(), client_id=1, run_name="r", keep=3)
    assert store.load(before=1) is None
    store.save(1, tensors(1.0))
    store.save(2, tensors(2.0))
    assert store.load(before=2)["head.bias"][0] == 1.0
    assert store.load(before=3)["head.bias"][0] == 2.0
    assert store.load(at_most=2)["head.bias"][0] == 2.0
    assert store.load(at_most=1)["head.bias"][0] == 1.0


def test_only_the_last_rounds_are_kept(tmp_path: Path) -> None:
    store = ClientStateStore(RecordDict(), 4, "run", str(tmp_path), keep=2)
    for r in range(1, 6):
        store.save(r, tensors(float(r)))
    assert store.rounds() == [4, 5]
    assert sorted(p.name for p in store.directory.iterdir()) == [
        "round_00004.safetensors",
        "round_00005.safetensors",
    ]


def test_a_restarted_client_reads_its_state_from_disk(tmp_path: Path) -> None:
    store = ClientStateStore(RecordDict(), 2, "exp/1", str(tmp_path))
    store.save(3, tensors(3.0))
    restarted = ClientStateStore(RecordDict(), 2, "exp/1", str(tmp_path))  # empty context
    loaded = restarted.load(before=4)
    assert torch.equal(loaded["head.weight"], tensors(3.0)["head.weight"])
    other_client = ClientStateStore(RecordDict(), 5, "exp/1", str(tmp_path))
    assert other_client.load(before=4) is None
    other_run = ClientStateStore(RecordDict(), 2, "another", str(tmp_path))
    assert other_run.load(before=4) is None
    assert not list(tmp_path.rglob("*.tmp"))
