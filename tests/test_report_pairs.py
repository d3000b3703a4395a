"""TAP's per-pair table (Welch's t-test against a reference) and replacement counts, reported."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import matplotlib.pyplot
import numpy as np
import pytest
from scipy import stats

from fedfm_flower.report import pair_table, replacements
from fedfm_flower.report.build import main as report_main
from fedfm_flower.report.runs import load_runs

SETUP = "multitask-3"
# the pairs each client holds (different on purpose: a row's units are its holders only)
HOLDS = {
    0: ("image-cls", "image-gen"),
    1: ("image-cls", "vqa", "text-gen"),
    2: ("image-gen", "vqa", "text-cls", "text-gen"),
}
# final per-client values: method -> (metric, pair) -> seed -> {client: value}
FINAL = {
    "fedavg": {
        ("accuracy", "image-cls"): {0: {0: 0.60, 1: 0.62}, 1: {0: 0.61, 1: 0.59}},
        ("mse", "image-gen"): {0: {0: 0.50, 2: 0.52}, 1: {0: 0.49, 2: 0.51}},
        ("bertscore", "vqa"): {0: {1: 0.60, 2: 0.50}, 1: {1: 0.45, 2: 0.70}},
        ("meteor", "vqa"): {0: {1: 0.40, 2: 0.42}, 1: {1: 0.41, 2: 0.39}},
        ("accuracy", "text-cls"): {0: {2: 0.80}, 1: {2: 0.85}},
        ("bertscore", "text-gen"): {0: {1: 0.30, 2: 0.34}, 1: {1: 0.31, 2: 0.35}},
        ("meteor", "text-gen"): {0: {1: 0.10, 2: 0.12}, 1: {1: 0.14, 2: 0.09}},
    },
    "tap": {
        ("accuracy", "image-cls"): {0: {0: 0.80, 1: 0.82}, 1: {0: 0.81, 1: 0.83}},
        ("mse", "image-gen"): {0: {0: 0.30, 2: 0.32}, 1: {0: 0.31, 2: 0.29}},
        ("bertscore", "vqa"): {0: {1: 0.70, 2: 0.40}, 1: {1: 0.55, 2: 0.65}},
        ("meteor", "vqa"): {0: {1: 0.20, 2: 0.22}, 1: {1: 0.21, 2: 0.19}},
        ("accuracy", "text-cls"): {0: {2: 0.90}, 1: {2: 0.70}},
        ("bertscore", "text-gen"): {0: {1: 0.36, 2: 0.33}, 1: {1: 0.32, 2: 0.38}},
        ("meteor", "text-gen"): {0: {1: 0.15, 2: 0.11}, 1: {1: 0.13, 2: 0.16}},
    },
}
ROWS = [
    ("accuracy", "image-cls"),
    ("mse", "image-gen"),
    ("bertscore", "vqa"),
    ("meteor", "vqa"),
    ("accuracy", "text-cls"),
    ("bertscore", "text-gen"),
    ("meteor", "text-gen"),
]
# TAP's replacement flags per seed, federated round and client (a client absent: not sampled)
REPLACED = {
    0: {
        1: {
            0: {"image-cls": 1, "image-gen": 1},
            1: {"image-cls": 1, "vqa": 1, "text-gen": 1},
            2: {"image-gen": 1, "vqa": 1, "text-cls": 1, "text-gen": 1},
        },
        2: {
            0: {"image-cls": 0, "image-gen": 1},
            1: {"image-cls": 1, "vqa": 0, "text-gen": 0},
            2: {"image-gen": 0, "vqa": 0, "text-cls": 1, "text-gen": 0},
        },
        3: {
            1: {"image-cls": 0, "vqa": 0, "text-gen": 1},
            2: {"image-gen": 0, "vqa": 1, "text-cls": 0, "text-gen": 0},
        },
    },
    1: {
        1: {
            0: {"image-cls": 1, "image-gen": 1},
            1: {"image-cls": 1, "vqa": 1, "text-gen": 1},
            2: {"image-gen": 1, "vqa": 1, "text-cls": 1, "text-gen": 1},
        },
        2: {
            0: {"image-cls": 1, "image-gen": 1},
            1: {"image-cls": 0, "vqa": 1, "text-gen": 0},
            2: {"image-gen": 1, "vqa": 0, "text-cls": 0, "text-gen": 1},
        },
        3: {
            0: {"image-cls": 0, "image-gen": 0},
            1: {"image-cls": 0, "vqa": 0, "text-gen": 0},
            2: {"image-gen": 0, "vqa": 0, "text-cls": 1, "text-gen": 0},
        },
    },
}
# the same counted by hand: pair -> seed -> clients replacing at rounds 1, 2, 3
COUNTS = {
    "image-cls": {0: [2, 1, 0], 1: [2, 1, 0]},
    "image-gen": {0: [2, 1, 0], 1: [2, 2, 0]},
    "vqa": {0: [2, 0, 1], 1: [2, 1, 0]},
    "text-cls": {0: [1, 1, 0], 1: [1, 0, 1]},
    "text-gen": {0: [2, 0, 1], 1: [2, 1, 0]},
}


def write_run(root: Path, label: str, seed: int) -> Path:
    """A finished ``multitask`` run: 3 federated rounds (evaluated at 2) and a post-training
    round 4 (evaluated, the final evaluation); TAP's training replies carry replacement flags."""
    path = root / f"{label}-s{seed}"
    path.mkdir(parents=True)
    config = {"method": label, "label": label, "setup": SETUP, "dataset": "multitask", "seed": seed}
    (path / "config.json").write_text(json.dumps({"run-config": config}))
    records = []
    for server_round in (1, 2, 3, 4):
        phase = "train" if server_round <= 3 else "post-training"
        train = {}
        for c in HOLDS:
            metrics = {"client-id": float(c), "train-loss": 1.0}
            if label == "tap" and phase == "train":
                if c not in REPLACED[seed][server_round]:
                    continue  # not sampled this round
                flags = REPLACED[seed][server_round][c]
                metrics |= {f"train-replaced-{p}": float(v) for p, v in flags.items()}
            train[str(700 + 5 * c)] = metrics  # node ids are not client ids
        record = {
            "round": server_round,
            "phase": phase,
            "train": train,
            "bytes-down": 1000,
            "bytes-up": 500,
            "clients-reported": len(train),
        }
        if server_round in (2, 4):
            shift = 0.25 if server_round == 2 else 0.0  # only the last evaluation counts
            evaluate = {}
            for c, pairs in HOLDS.items():
                metrics = {"client-id": float(c), "num-examples": 40.0, "test-task-score": 0.5}
                metrics["test-meteor-wordnet"] = 1.0  # not a pair
                for (metric, pair), by_seed in FINAL[label].items():
                    if c in by_seed[seed]:
                        metrics[f"test-{metric}-{pair}"] = by_seed[seed][c] - shift
                        metrics[f"test-loss-{pair}"] = 2.0  # not a reported metric
                assert {k.split("-", 2)[2] for k in metrics if "loss-" in k} == set(pairs)
                evaluate[str(700 + 5 * c)] = metrics
            record["evaluate"] = evaluate
        records.append(record)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "summary.json").write_text(json.dumps({"primary-metric": "task-score"}))
    return path


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    """Two methods x two seeds of the fixture's runs."""
    root = tmp_path / "runs"
    for label in FINAL:
        for seed in (0, 1):
            write_run(root, label, seed)
    return root


def scale(metric: str) -> float:
    """The factor the table shows a metric in."""
    return 1.0 if metric == "mse" else 100.0


def expected_cell(label: str, row: tuple[str, str]) -> tuple[float, float]:
    """Mean over seeds of the seeds' client means, and its 95% half-width (scipy's t interval)."""
    per_seed = [scale(row[0]) * np.mean(list(v.values())) for v in FINAL[label][row].values()]
    low, high = stats.t.interval(0.95, 1, loc=np.mean(per_seed), scale=stats.sem(per_seed))
    return float(np.mean(per_seed)), (high - low) / 2


def expected_test(label: str, reference: str, row: tuple[str, str]) -> tuple[float, str]:
    """scipy's Welch p over the (seed, client) values, and the mark it gives."""
    a = [x for v in FINAL[label][row].values() for x in v.values()]
    b = [x for v in FINAL[reference][row].values() for x in v.values()]
    p = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
    if not p < 0.05:
        return p, ""
    better = np.mean(a) < np.mean(b) if row[0] == "mse" else np.mean(a) > np.mean(b)
    return p, "↑" if better else "↓"


def test_cells_match_an_independent_computation(runs_dir: Path) -> None:
    runs, _ = load_runs([runs_dir])
    table = pair_table.build_pair_table(runs, SETUP, reference="fedavg")
    assert table.rows == tuple(ROWS)  # pair order of MULTITASK_TASKS; no loss/wordnet rows
    assert table.labels == ("fedavg", "tap")  # the reference first
    for row in ROWS:
        for label in FINAL:
            cell = table.cells[row][label]
            mean, half = expected_cell(label, row)
            assert (cell.mean, cell.ci) == pytest.approx((mean, half))
            assert cell.seeds == (0, 1)
            assert len(cell.units) == sum(len(v) for v in FINAL[label][row].values())
    text = pair_table.markdown_pair_table(table)
    mean, half = expected_cell("tap", ("mse", "image-gen"))
    assert "| mse image-gen (lower is better) | " in text
    assert f"{mean:.4f} ± {half:.4f}↑ |" in text  # MSE raw, 4 decimals
    mean, half = expected_cell("fedavg", ("accuracy", "image-cls"))
    assert f"| accuracy image-cls (higher is better) | {mean:.2f} ± {half:.2f} |" in text
    assert "Welch's t-test" in text and "p < 0.05" in text and "MSE: lower is better" in text
    assert "| metric pair | fedavg (reference) | tap |" in text


@pytest.mark.parametrize("reference", ["fedavg", "tap"])
def test_welch_marks_agree_with_scipy(runs_dir: Path, reference: str) -> None:
    runs, _ = load_runs([runs_dir])
    table = pair_table.build_pair_table(runs, SETUP, reference=reference)
    other = "tap" if reference == "fedavg" else "fedavg"
    marks = {}
    for row in ROWS:
        assert table.cells[row][reference].versus is None and table.cells[row][reference].mark == ""
        cell = table.cells[row][other]
        p, mark = expected_test(other, reference, row)
        assert cell.versus.p_value == pytest.approx(p)
        assert cell.mark == mark
        marks[row] = cell.mark
    # the fixture exercises every verdict, and MSE's reversed direction
    win, loss = ("↑", "↓") if reference == "fedavg" else ("↓", "↑")
    assert marks[("mse", "image-gen")] == win  # TAP's MSE is lower: better
    assert marks[("accuracy", "image-cls")] == win
    assert marks[("meteor", "vqa")] == loss
    assert marks[("bertscore", "vqa")] == "" and marks[("accuracy", "text-cls")] == ""
    text = pair_table.markdown_pair_table(table)
    p, _ = expected_test(other, reference, ("mse", "image-gen"))
    over_seeds = table.cells[("mse", "image-gen")][other].over_seeds
    seeds_p, seeds_mark = expected_over_seeds(other, reference, ("mse", "image-gen"))
    assert over_seeds.p_value == pytest.approx(seeds_p)
    assert f"| mse image-gen | {p:.3g} (4 vs 4){win}; seeds: {seeds_p:.3g}{seeds_mark} |" in text


def expected_over_seeds(label: str, reference: str, row: tuple[str, str]) -> tuple[float, str]:
    """scipy's paired t-test over the seeds' means, and the mark it gives."""
    seeds = sorted(FINAL[label][row])
    a = [np.mean(list(FINAL[label][row][s].values())) for s in seeds]
    b = [np.mean(list(FINAL[reference][row][s].values())) for s in seeds]
    p = float(stats.ttest_rel(a, b).pvalue)
    if not p < 0.05:
        return p, ""
    better = np.mean(a) < np.mean(b) if row[0] == "mse" else np.mean(a) > np.mean(b)
    return p, "↑" if better else "↓"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_welch_edge_cases_follow_scipy() -> None:
    assert pair_table.welch_test([0.5], [0.1, 0.2]) is None  # too few values: no test
    equal = pair_table.welch_test([0.5, 0.5], [0.5, 0.5])  # undefined: no mark
    assert np.isnan(equal.p_value) and pair_table.mark_of(equal, "accuracy") == ""
    apart = pair_table.welch_test([0.7, 0.7], [0.3, 0.3])  # constant but apart: p = 0
    assert apart.p_value == 0.0 and pair_table.mark_of(apart, "accuracy") == "↑"
    assert pair_table.mark_of(apart, "mse") == "↓"


def test_runs_without_pair_metrics_get_no_table_and_no_replacements(tmp_path: Path) -> None:
    path = tmp_path / "glyphs-s0"
    path.mkdir()
    config = {"method": "local", "setup": "glyphs", "dataset": "glyphs", "seed": 0}
    (path / "config.json").write_text(json.dumps({"run-config": config}))
    record = {
        "round": 1,
        "train": {"3": {"client-id": 0.0, "train-loss": 1.0}},
        "evaluate": {"3": {"client-id": 0.0, "test-accuracy": 0.7}},
        "bytes-down": 1,
        "bytes-up": 1,
        "clients-reported": 1,
    }
    (path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    (path / "summary.json").write_text(json.dumps({"primary-metric": "accuracy"}))
    runs, _ = load_runs([tmp_path])
    assert pair_table.build_pair_table(runs, "glyphs", "local") is None
    assert replacements.replacement_counts(runs, "glyphs") == {}


def test_replacement_counts_and_figure(
    runs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs, _ = load_runs([runs_dir])
    counts = replacements.replacement_counts(runs, SETUP)
    assert list(counts) == ["tap"]  # FedAvg reports no flags
    assert list(counts["tap"]) == list(COUNTS)  # MULTITASK_TASKS order
    for pair, by_seed in COUNTS.items():
        numbers = counts["tap"][pair]
        assert numbers["rounds"] == [1, 2, 3]  # the post-training round 4 is not one
        assert numbers["per-seed"] == {str(s): v for s, v in by_seed.items()}
        per_round = np.array([by_seed[0], by_seed[1]])
        assert numbers["mean"] == pytest.approx(per_round.mean(axis=0))
        assert numbers["min"] == pytest.approx(per_round.min(axis=0))
        assert numbers["max"] == pytest.approx(per_round.max(axis=0))
        assert numbers["cumulative-mean"] == pytest.approx(np.cumsum(per_round.mean(axis=0)))
    assert counts["tap"]["image-gen"]["mean"] == [2.0, 1.5, 0.0]
    assert counts["tap"]["image-cls"]["clients-reporting"]["0"] == [2, 2, 1]  # c0 not sampled

    kept = []
    monkeypatch.setattr(matplotlib.pyplot, "close", kept.append)
    path = replacements.replacement_figure(counts, SETUP, tmp_path / "replacements.png")
    (figure,) = kept
    top, bottom = figure.axes
    for line, (pair, by_seed) in zip(top.get_lines(), COUNTS.items(), strict=True):
        assert line.get_label() == pair
        assert list(line.get_xdata()) == [1, 2, 3]
        assert list(line.get_ydata()) == pytest.approx(np.mean([by_seed[0], by_seed[1]], axis=0))
    for line, pair in zip(bottom.get_lines(), COUNTS, strict=True):
        assert list(line.get_ydata()) == counts["tap"][pair]["cumulative-mean"]
    monkeypatch.undo()
    matplotlib.pyplot.close(figure)
    assert matplotlib.image.imread(path).shape[:2] == (768, 576)


def test_report_command_writes_the_table_and_the_figure(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert report_main([str(runs_dir), "--out", str(out), "--reference", "fedavg"]) == 0
    table = (out / f"pairs-{SETUP}.md").read_text()
    assert table.strip() in (out / "report.md").read_text()
    assert (out / f"replacements-{SETUP}.png").is_file()
    assert f"](replacements-{SETUP}.png)" in (out / "report.md").read_text()
    numbers = json.loads((out / "report.json").read_text())
    pairs = numbers["pair-tables"][SETUP]
    assert pairs["reference"] == "fedavg" and pairs["test"] == "welch" and pairs["alpha"] == 0.05
    assert list(pairs["rows"]) == [f"{m} {p}" for m, p in ROWS]
    row = pairs["rows"]["mse image-gen"]
    assert row["lower-is-better"] and row["scale"] == 1.0
    mean, half = expected_cell("tap", ("mse", "image-gen"))
    assert (row["methods"]["tap"]["mean"], row["methods"]["tap"]["ci95"]) == pytest.approx(
        (mean, half)
    )
    p, _ = expected_test("tap", "fedavg", ("mse", "image-gen"))
    versus = row["methods"]["tap"]["versus-reference"]
    assert versus["p-value"] == pytest.approx(p) and versus["verdict"] == "better"
    assert row["methods"]["fedavg"]["versus-reference"] is None
    replaced = numbers["replacements"][SETUP]["tap"]
    assert replaced["vqa"]["per-seed"] == {"0": [2, 0, 1], "1": [2, 1, 0]}
