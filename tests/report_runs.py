"""Run directories as the runner writes them, for the report's tests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_run_dir(
    root: Path,
    label: str,
    seed: int,
    final: Sequence[float],
    finished: bool = True,
    setup: str = "toy",
    config: dict[str, Any] | None = None,
) -> Path:
    """A run of ``label`` on ``setup`` at ``seed`` whose clients (ids 0..) end at ``final``:
    3 rounds, evaluated at rounds 2 and 3; ``config`` adds run-config keys."""
    path = root / f"{label}-s{seed}"
    path.mkdir(parents=True)
    run_config = {"method": label, "label": label, "setup": setup, "dataset": "digits"}
    run_config |= {"seed": seed, **(config or {})}
    (path / "config.json").write_text(json.dumps({"run-config": run_config}))
    records = []
    for server_round in (1, 2, 3):
        record = {
            "round": server_round,
            "bytes-down": 4000 * server_round,
            "bytes-up": 2000,
            "clients-reported": len(final),
        }
        if server_round >= 2:
            shift = 0.1 if server_round == 2 else 0.0
            # node ids differ from client ids (as in Flower simulation): pairing uses client ids
            record["evaluate"] = {
                str(1000 + 7 * c): {
                    "client-id": float(c),
                    "test-accuracy": v - shift,
                    "test-error": 1.0 - (v - shift),
                }
                for c, v in enumerate(final)
            }
        records.append(record)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if finished:
        (path / "summary.json").write_text(json.dumps({"primary-metric": "accuracy"}))
    return path
