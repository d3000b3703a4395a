"""The privacy report: runs grouped by (method, DP mode, sigma), epsilon and metric over seeds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedfm_flower.report.privacy import main, privacy_points
from fedfm_flower.report.runs import load_runs
from fedfm_flower.study.statistics import mean_ci


def write_run(root: Path, label: str, seed: int, accuracy: list[float], dp: dict | None) -> None:
    sigma = "none" if dp is None else dp["dp-noise-multiplier"]
    path = root / f"{label}-s{seed}-{sigma}"
    path.mkdir(parents=True)
    config = {"method": label, "label": label, "setup": "digits", "dataset": "digits", "seed": seed}
    (path / "config.json").write_text(json.dumps({"run-config": config}))
    evaluate = {str(c): {"client-id": c, "test-accuracy": a} for c, a in enumerate(accuracy)}
    record = {
        "round": 1,
        "evaluate": evaluate,
        "bytes-down": 1,
        "bytes-up": 1,
        "clients-reported": 2,
    }
    (path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    summary = {"primary-metric": "accuracy", **({"dp": "none"} if dp is None else dp)}
    (path / "summary.json").write_text(json.dumps(summary))


def test_points_group_by_method_and_sigma_with_the_seeds_means(tmp_path: Path) -> None:
    for seed, (a, b) in enumerate([(0.8, 0.6), (0.9, 0.7), (0.7, 0.9)]):
        write_run(tmp_path, "fedavg", seed, [a, b], None)
        private = {"dp": "central", "dp-noise-multiplier": 1.0, "dp-epsilon": 12.5}
        write_run(tmp_path, "fedavg", seed, [a - 0.2, b - 0.2], private)
    runs, _ = load_runs([tmp_path])
    points = privacy_points(runs)
    assert [(p.label, p.mode, p.epsilon) for p in points] == [
        ("fedavg", "central", 12.5),
        ("fedavg", "none", math.inf),
    ]
    private, plain = points
    assert private.seeds == plain.seeds == (0, 1, 2)
    assert plain.values == pytest.approx((0.7, 0.8, 0.8))
    assert private.mean_ci == pytest.approx(mean_ci([0.5, 0.6, 0.6]))

    out = tmp_path / "report"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    table = (out / "privacy.md").read_text()
    assert "| fedavg | central | 1 | 12.5 | 56.67 ±" in table
    assert "| fedavg | none | - | inf | 76.67 ±" in table
    payload = json.loads((out / "privacy.json").read_text())
    assert payload["points"][1]["epsilon"] is None and (out / "privacy.png").stat().st_size > 0


def test_runs_of_one_group_that_spent_different_epsilons_are_refused(tmp_path: Path) -> None:
    for seed, epsilon in ((0, 3.0), (1, 4.0)):
        dp = {"dp": "central", "dp-noise-multiplier": 1.0, "dp-epsilon": epsilon}
        write_run(tmp_path, "fedavg", seed, [0.5], dp)
    runs, _ = load_runs([tmp_path])
    with pytest.raises(ValueError, match="different epsilons"):
        privacy_points(runs)


def test_runs_of_two_setups_or_two_runs_of_one_seed_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for seed in (0, 1):
        write_run(tmp_path / "a", "fedavg", seed, [0.5], None)
    write_run(tmp_path / "b", "fedavg", 0, [0.6], None)  # seed 0 again
    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path), "--out", str(tmp_path / "r")])
    assert exited.value.code == 2
    assert "fedavg (none, sigma inf): two runs of one seed in [0, 0, 1]" in capsys.readouterr().err
    config = tmp_path / "b" / "fedavg-s0-none" / "config.json"
    made = json.loads(config.read_text())
    made["run-config"]["setup"] = "other"
    config.write_text(json.dumps(made))
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--out", str(tmp_path / "r")])
    assert "runs of 2 setups (digits, other)" in capsys.readouterr().err
