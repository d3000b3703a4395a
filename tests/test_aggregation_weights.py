"""A training reply's weight is the client's data size |D_i|, in step mode as in epoch mode.

With ``local-steps`` every client trains on steps x batch examples; were that the weight, the
example-weighted averages (FedAvg's eq. 1, FedPerfix's eq. 2, TAP's eq. 1) would silently be
uniform. The examples seen travel as their own metric, ``examples-seen``. That the strategies weigh
by ``num-examples``: tests/test_strategies.py::test_fedavg_aggregates_with_example_weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from fedfm_flower.records import protocol as P


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_step_mode_replies_weigh_by_data_size_and_report_examples_seen(
    small_run_config: dict,
) -> None:
    from server_apps.inprocess import run_in_process

    config = {
        **small_run_config,
        "method": "fedavg",
        "num-server-rounds": 1,
        "local-steps": 3,
        "batch-size": 4,
        "run-name": "steps",
    }
    summary, _ = run_in_process(config, 4)
    sizes = {c: e["train"] for c, e in summary["client-examples"].items()}
    assert len(set(sizes.values())) > 1, "the label-skew partition must be unequal here"
    (record,) = _records(Path(config["output-dir"]) / "steps")
    assert set(record["train"]) == set(sizes)
    for client, reply in record["train"].items():
        assert reply[P.NUM_EXAMPLES] == sizes[client]  # the weight: |D_i|
        assert reply[P.EXAMPLES_SEEN] == 3 * 4  # what the loop trained on
