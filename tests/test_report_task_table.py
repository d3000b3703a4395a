"""FedDPA's Table 1 layout in the report: ROUGE-1 per client task, two blocks, seeds' intervals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedfm_flower.data.instructions import client_task
from fedfm_flower.report import task_table
from fedfm_flower.report.build import main as report_main
from fedfm_flower.report.runs import load_runs

# final per-client values: method -> seed -> three clients (ids 0..2)
ROUGE = {
    "fedlora": {0: [0.70, 0.81, 0.95], 1: [0.74, 0.78, 0.97]},
    "feddpa-t": {0: [0.78, 0.84, 0.96], 1: [0.80, 0.83, 0.99]},
}
TTP = {
    "fedlora": {0: [0.75, 0.74, 0.77], 1: [0.73, 0.76, 0.78]},
    "feddpa-t": {0: [0.77, 0.78, 0.76], 1: [0.79, 0.75, 0.80]},
}
SETUP = "instructions-8"


def write_run(
    root: Path,
    label: str,
    seed: int,
    dataset: str = "instructions",
    extra: dict | None = None,
    ttp: bool = True,
    clients: tuple[int, ...] = (0, 1, 2),
) -> Path:
    """A finished run directory as the runner writes it: 2 rounds, evaluated in both."""
    path = root / f"{label}-s{seed}"
    path.mkdir(parents=True)
    config = {"method": label, "label": label, "setup": SETUP, "dataset": dataset, "seed": seed}
    (path / "config.json").write_text(json.dumps({"run-config": config, **(extra or {})}))
    records = []
    for server_round in (1, 2):
        shift = 0.2 if server_round == 1 else 0.0  # only the last evaluation counts
        evaluate = {}
        for c in clients:
            metrics = {
                "client-id": float(c),
                "num-examples": 28.0,
                "test-rouge-1": ROUGE[label][seed][c] - shift,
                "test-rouge-l": 0.5,
            }
            if ttp:
                metrics["test-ttp-rouge-1"] = TTP[label][seed][c] - shift
                metrics["test-alpha"] = 0.4
            evaluate[str(500 + 3 * c)] = metrics  # node ids are not client ids
        records.append(
            {
                "round": server_round,
                "bytes-down": 1000,
                "bytes-up": 500,
                "clients-reported": len(clients),
                "evaluate": evaluate,
            }
        )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "summary.json").write_text(json.dumps({"primary-metric": "rouge-1"}))
    return path


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for label in ROUGE:
        for seed in (0, 1):
            write_run(root, label, seed)
    return root


def expected_cell(per_seed: list[float]) -> tuple[float, float]:
    """Mean and 95% half-width over seeds, independently (scipy's t interval)."""
    mean = float(np.mean(per_seed))
    if len(per_seed) < 2:
        return mean, 0.0
    low, high = stats.t.interval(0.95, len(per_seed) - 1, loc=mean, scale=stats.sem(per_seed))
    return mean, (high - low) / 2


def test_cells_match_an_independent_computation(runs_dir: Path) -> None:
    runs, _ = load_runs([runs_dir])
    table = task_table.build_task_table(runs, SETUP)
    tasks = [client_task(c) for c in range(3)]
    assert tasks == ["paraphrase", "entailment", "sentiment"]
    assert table.columns == (*tasks, "Average")
    assert list(table.blocks) == ["Personalization", "Test-time personalization"]
    for title, source in (("Personalization", ROUGE), ("Test-time personalization", TTP)):
        for label, by_seed in source.items():
            row = table.blocks[title][label]
            for c, task in enumerate(tasks):
                mean, half = expected_cell([100 * by_seed[s][c] for s in (0, 1)])
                assert row[task].mean == pytest.approx(mean)
                assert row[task].ci == pytest.approx(half)
                assert row[task].seeds == (0, 1)
            mean, half = expected_cell([100 * np.mean(by_seed[s]) for s in (0, 1)])
            assert row["Average"].mean == pytest.approx(mean)
            assert row["Average"].ci == pytest.approx(half)
    text = task_table.markdown_task_table(table)
    assert "| method | paraphrase | entailment | sentiment | Average |" in text
    assert "| *Personalization* | | | | |" in text
    mean, half = expected_cell([100 * ROUGE["feddpa-t"][s][0] for s in (0, 1)])
    assert f"| feddpa-t | {mean:.2f} ± {half:.2f} |" in text
    assert text.index("*Personalization*") < text.index("*Test-time personalization*")


def test_clients_sharing_a_task_make_one_column(tmp_path: Path) -> None:
    """A stored task map wins over the config; two clients of one task average in its column."""
    stored = {"client-tasks": {"0": "qa", "1": "qa", "2": "summaries"}}
    for seed in (0, 1):
        write_run(tmp_path, "fedlora", seed, extra=stored)
    runs, _ = load_runs([tmp_path])
    table = task_table.build_task_table(runs, SETUP)
    assert table.columns == ("qa", "summaries", "Average")
    row = table.blocks["Personalization"]["fedlora"]
    by_seed = ROUGE["fedlora"]
    qa = [100 * np.mean(by_seed[s][:2]) for s in (0, 1)]
    assert (row["qa"].mean, row["qa"].ci) == pytest.approx(expected_cell(qa))
    average = [(q + 100 * by_seed[s][2]) / 2 for q, s in zip(qa, (0, 1), strict=True)]
    assert (row["Average"].mean, row["Average"].ci) == pytest.approx(expected_cell(average))


def test_tasks_follow_the_partition_each_clients_node_reported(tmp_path: Path) -> None:
    """A deployment numbering client ids apart from partitions: the stored map is by partition,
    so client 0 (partition 2) is in partition 2's column and client 2 (partition 0) in 0's."""
    stored = {"client-tasks": {"0": "qa", "1": "dialogue", "2": "summaries"}}
    for seed in (0, 1):
        path = write_run(tmp_path, "fedlora", seed, extra=stored)
        summary = json.loads((path / "summary.json").read_text())
        summary["client-partitions"] = {"0": 2, "1": 1, "2": 0}
        (path / "summary.json").write_text(json.dumps(summary))
    runs, _ = load_runs([tmp_path])
    assert task_table.client_tasks(runs[0].path, [0, 1, 2]) == {
        0: "summaries",
        1: "dialogue",
        2: "qa",
    }
    table = task_table.build_task_table(runs, SETUP)
    assert table.columns == ("summaries", "dialogue", "qa", "Average")
    row = table.blocks["Personalization"]["fedlora"]
    by_seed = ROUGE["fedlora"]
    for client, task in ((0, "summaries"), (2, "qa")):
        expected = expected_cell([100 * by_seed[s][client] for s in (0, 1)])
        assert (row[task].mean, row[task].ci) == pytest.approx(expected)


def test_instruction_tasks_of_a_run_without_a_stored_map_follow_partitions(tmp_path: Path) -> None:
    path = write_run(tmp_path, "fedlora", 0)
    (path / "summary.json").write_text(json.dumps({"client-partitions": {"0": 1, "1": 0}}))
    tasks = task_table.client_tasks(path, [0, 1, 2])
    assert tasks == {0: client_task(1), 1: client_task(0), 2: client_task(2)}
    assert tasks[0] != tasks[1]


def test_other_datasets_name_clients_and_runs_without_ttp_skip_that_block(
    tmp_path: Path,
) -> None:
    write_run(tmp_path, "fedlora", 0, dataset="flan", ttp=False)
    write_run(tmp_path, "fedlora", 1, dataset="flan", ttp=False, clients=(0, 1))
    runs, _ = load_runs([tmp_path])
    table = task_table.build_task_table(runs, SETUP)
    assert table.columns == ("client 0", "client 1", "client 2", "Average")
    assert list(table.blocks) == ["Personalization"]
    row = table.blocks["Personalization"]["fedlora"]
    assert row["client 2"].seeds == (0,) and row["client 2"].ci == 0.0  # one seed has it
    assert row["client 2"].mean == pytest.approx(100 * ROUGE["fedlora"][0][2])
    assert row["client 0"].seeds == (0, 1)
    assert row["Average"].seeds == (0,)  # seed 1 lacks a task: no average over the others
    assert row["Average"].mean == pytest.approx(100 * np.mean(ROUGE["fedlora"][0]))


def test_a_run_without_rouge_gets_no_table(tmp_path: Path) -> None:
    path = write_run(tmp_path, "fedlora", 0)
    lines = (path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for record in records:
        for metrics in record["evaluate"].values():
            metrics["test-accuracy"] = metrics.pop("test-rouge-1")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "summary.json").write_text(json.dumps({"primary-metric": "accuracy"}))
    runs, _ = load_runs([tmp_path])
    assert task_table.build_task_table(runs, SETUP) is None


def test_report_command_writes_the_table(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert report_main([str(runs_dir), "--out", str(out), "--reference", "fedlora"]) == 0
    table = (out / f"feddpa-table-{SETUP}.md").read_text()
    assert "*Test-time personalization*" in table and "| fedlora |" in table
    assert table.strip() in (out / "report.md").read_text()
    numbers = json.loads((out / "report.json").read_text())["feddpa-tables"][SETUP]
    cell = numbers["blocks"]["Test-time personalization"]["feddpa-t"]["Average"]
    mean, half = expected_cell([100 * np.mean(TTP["feddpa-t"][s]) for s in (0, 1)])
    assert cell == {"mean": pytest.approx(mean), "ci95": pytest.approx(half), "seeds": [0, 1]}
