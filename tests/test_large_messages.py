"""A LoRA adapter of a 7B model's size (134 MB in float32) both ways through a secure loopback
deployment (Flower's 5 MiB chunks), checked exactly; the time and every process's peak memory
are recorded (bench.large_messages)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.large_messages import measure, table

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(600)
def test_a_7b_size_lora_adapter_travels_both_ways_exactly(tmp_path: Path) -> None:
    result = measure(tmp_path, supernodes=1, rank=64)
    # r = 64 on q and v of 32 layers of width 4,096: 2 * 32 * 2 * 64 * 4,096 float32 values
    assert result["adapter-bytes"] == 2 * 32 * 2 * 64 * 4096 * 4 > 130e6
    assert result["tensors"] == 128 and result["nodes"] == 1
    # the ServerApp checked the echo (received + 1) value by value, or the run would have failed
    (client,) = result["clients"]
    assert client["decode-seconds"] > 0 and client["peak-rss-mb"] > result["adapter-bytes"] / 1e6
    roles = {p["role"] for p in result["processes"]}
    assert {"flower-superlink", "supernode", "superexec"} <= roles, roles
    # no copy explosion: no process of the deployment peaks above 12 adapters' worth (measured:
    # the ServerApp 9.8, holding the tensors, their record, the message, the echo and torch)
    limit = 12 * result["adapter-bytes"] / 2**20
    for process in result["processes"]:
        assert process["peak-rss-mb"] < limit, process
    assert result["serverapp-peak-rss-mb"] < limit
    assert "round trip" in table(result)
