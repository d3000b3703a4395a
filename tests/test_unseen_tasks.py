"""FedDPA's Table 14: test-time tasks outside the federation. Each client answers the unseen
tasks' test examples (``unseen-test-dir``'s files, the offline ``unseen-tasks``) and reports
ROUGE per unseen task; the report takes the mean (AVG) and the highest client (MAX) per task;
the table ``feddpa-t14`` lays them out as the paper, bad declarations refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from torch.utils.data import TensorDataset

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.records import protocol as P
from fedfm_flower.report.paper_table import markdown_paper_table, paper_table_numbers
from fedfm_flower.report.runs import load_runs
from fedfm_flower.report.task_table import (
    UNSEEN_AVG,
    UNSEEN_MAX,
    build_task_table,
    markdown_task_table,
)
from fedfm_flower.study.paper_tables import load_table
from tests.report_runs import write_run_dir
from tests.test_language_task import LANGUAGE


def _config(run_config: dict) -> ExperimentConfig:
    return ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **run_config})


def _write_unseen_dir(root: Path) -> Path:
    """Two files of task ``gigaword`` (its category, the first by two records to one) and one
    without categories (named by its file), two examples each."""
    root.mkdir(parents=True)
    records = [
        {"instruction": "Shorten: Ann gave a red book to Bob.", "output": "Ann gave Bob a book."},
        {"instruction": "Shorten: Cara sold a lamp to Dan.", "output": "Cara sold a lamp."},
    ]
    gigaword = [{**r, "category": "gigaword"} for r in records]
    (root / "a.json").write_text(json.dumps([*gigaword, {**records[0], "category": "other"}]))
    (root / "b.jsonl").write_text(json.dumps(gigaword[1]) + "\n")
    (root / "open_qa.json").write_text(json.dumps(records))
    return root


def test_each_client_answers_the_unseen_tasks_per_task(small_run_config, tmp_path) -> None:
    from fedfm_flower.models import build_model
    from fedfm_flower.tasks.instructions import InstructionFollowing, InstructionTest

    unseen_dir = _write_unseen_dir(tmp_path / "unseen")
    config = _config(
        {
            **small_run_config,
            **LANGUAGE,
            "num-clients": 2,
            "test-time-evaluation": True,
            "unseen-test-dir": str(unseen_dir),
            "unseen-tasks": "word_sorting",
            "val-fraction": 0.1,
        }
    )
    task = InstructionFollowing()
    data = task.client_data(config, 0, 2)
    unseen = dict(data.test.unseen)
    assert list(unseen) == ["gigaword", "open_qa", "word_sorting"]  # sorted
    assert len(unseen["gigaword"]) == 4 and len(unseen["open_qa"]) == 2  # files of a task pool
    assert {e.task for e in unseen["gigaword"]} == {"gigaword"}  # the file's task for all
    assert unseen["word_sorting"] and {e.task for e in unseen["word_sorting"]} == {"word_sorting"}
    assert data.val is not None and data.val.unseen == ()  # the test split's evaluation only
    assert {e.task for others in data.test.others for e in others} == {"entailment"}  # ttp's

    # two examples of each, the loss on two rows, no other task: a short evaluation
    unseen = {name: examples[:2] for name, examples in unseen.items()}
    encoded = TensorDataset(*(rows[:2] for rows in data.test.encoded.tensors))
    test = InstructionTest(data.test.examples[:2], encoded, 4, 8, (), tuple(unseen.items()))
    model = build_model(config, "lora")
    stats_ = task.evaluate(model, test, torch.device("cpu"), 256)
    assert not any(key.startswith("ttp-") for key in stats_.metrics)
    for name, examples in unseen.items():
        alone = InstructionTest(examples, encoded, 4, 8)
        expected = task.evaluate(model, alone, torch.device("cpu"), 256).metrics
        for metric in ("rouge-1", "rouge-2", "rouge-l"):
            key = P.unseen_metric(name, metric)
            assert stats_.metrics[key] == pytest.approx(expected[metric]), key
    assert P.unseen_task_of(P.test_metric("unseen-open_qa-rouge-1"), "rouge-1") == "open_qa"

    # a task of the federation is no unseen task
    (unseen_dir / "c.json").write_text(
        json.dumps([{"instruction": "Same?", "output": "yes", "category": "paraphrase"}])
    )
    with pytest.raises(ValueError, match="unseen task 'paraphrase' is client 0's task"):
        task.example_counts(config, 2)  # what preflight reads


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"unseen-test-dir": "/no/such/dir"}, "'unseen-test-dir' = '/no/such/dir' is invalid: no"),
        ({"unseen-tasks": "summarization", "test-time-evaluation": False}, "needs test-time"),
        ({"unseen-tasks": "sentiment", "dataset": "flan"}, "names offline tasks of dataset 'ins"),
    ],
)
def test_bad_unseen_keys_are_refused_naming_the_key(changes: dict, message: str) -> None:
    base = {"dataset": "instructions", "backbone": "tiny-llama", "test-time-evaluation": True}
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config({**base, **changes})


@pytest.mark.parametrize(
    ("tasks", "message"),
    [("sentiment", "unseen task 'sentiment' is client 2's task"), ("poetry", "task 'poetry'")],
)
def test_preflight_refuses_an_unseen_task_of_the_federation_or_unknown(
    tasks: str, message: str
) -> None:
    """The task's example counts (what preflight reads) check the unseen tasks."""
    from fedfm_flower.tasks.instructions import InstructionFollowing

    config = _config(
        {"dataset": "instructions", "backbone": "tiny-llama", "test-time-evaluation": True}
    )
    assert InstructionFollowing().example_counts(config.replace(unseen_tasks="word_sorting"), 4)
    with pytest.raises(ValueError, match=f"run config 'unseen-.*{message}"):
        InstructionFollowing().example_counts(config.replace(unseen_tasks=tasks), 4)


# final per-client ROUGE-1: method -> seed -> clients 0..2; unseen: task -> per-client values
OWN = {"fedavg-ft": {0: [0.6, 0.7, 0.8], 1: [0.62, 0.7, 0.75]}}
OWN["feddpa-t"] = {0: [0.65, 0.72, 0.81], 1: [0.66, 0.74, 0.79]}
UNSEEN = {
    ("fedavg-ft", 0): {"summarization": [0.20, 0.24, 0.22], "open_domain_qa": [0.70, 0.8, 0.75]},
    ("fedavg-ft", 1): {"summarization": [0.21, 0.23, 0.25], "open_domain_qa": [0.72, 0.7, 0.78]},
    ("feddpa-t", 0): {"summarization": [0.22, 0.26, 0.21], "open_domain_qa": [0.76, 0.8, 0.79]},
    ("feddpa-t", 1): {"summarization": [0.23, 0.22, 0.27], "open_domain_qa": [0.74, 0.8, 0.83]},
}
SETUP = "feddpa-flan-dataset1-unseen"


def _write_runs(root: Path) -> None:
    """Finished flan runs (tests/report_runs.py) whose clients report ROUGE-1 on their task and
    on the unseen tasks."""
    for (label, seed), unseen in UNSEEN.items():
        path = write_run_dir(root, label, seed, OWN[label][seed], setup=SETUP)
        lines = (path / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        for record in records:
            for metrics in record.get("evaluate", {}).values():
                client = int(metrics["client-id"])
                metrics["test-rouge-1"] = metrics.pop("test-accuracy")
                for task, values in unseen.items():
                    metrics[P.test_metric(P.unseen_metric(task, "rouge-1"))] = values[client]
                    metrics[P.test_metric(P.unseen_metric(task, "rouge-2"))] = 0.0
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (path / "summary.json").write_text(json.dumps({"primary-metric": "rouge-1"}))


def _by_hand(values: list[float]) -> tuple[float, float]:
    """Mean and 95% half-width over seeds (scipy's t interval), in percent."""
    scaled = [100 * v for v in values]
    low, high = stats.t.interval(0.95, len(scaled) - 1, np.mean(scaled), stats.sem(scaled))
    return float(np.mean(scaled)), (high - low) / 2


def test_the_report_takes_avg_and_max_over_clients_per_unseen_task(tmp_path: Path) -> None:
    """The per-task table's unseen blocks and feddpa-t14's cells: per seed the mean (AVG) or
    the highest (MAX) over the clients, then mean ± 95% half-width over seeds, by hand; the
    paper's figures beside; FedIT's MAX blank; a declared unseen task no run has is named."""
    runs = tmp_path / "runs"
    _write_runs(runs)
    loaded, _ = load_runs([runs])
    table = build_task_table(loaded, SETUP)
    assert table.unseen_columns == ("open_domain_qa", "summarization")
    assert "unseen" not in " ".join(table.columns)  # the client-task columns are untouched
    expected = {}
    for label in OWN:
        for block, aggregate in ((UNSEEN_AVG, np.mean), (UNSEEN_MAX, np.max)):
            for task in table.unseen_columns:
                per_seed = [float(aggregate(UNSEEN[label, s][task])) for s in (0, 1)]
                expected[label, block, task] = _by_hand(per_seed)
                cell = table.blocks[block][label][task]
                assert (cell.mean, cell.ci) == pytest.approx(expected[label, block, task])

    document = load_table("feddpa-t14").to_json(stand_in=False)  # the sweep's table.json
    text = markdown_task_table(table) + "\n" + markdown_paper_table(document, {}, {SETUP: table})
    assert "| *Unseen tasks (MAX)* | | |" in text  # the per-task table's second table
    section = text[text.index("## FedDPA (Yang et al., NeurIPS 2024), Table 14") :]
    lines = [line for line in section.split("\n## ")[0].splitlines() if line.startswith("| ")]
    assert lines[0].startswith(
        "| row | method | Summarization AVG (`summarization` of "
        "`feddpa-flan-dataset1-unseen`, Unseen tasks (AVG)) | paper |"
    )

    def shown(label: str, block: str, task: str) -> str:
        mean, half = expected[label, block, task]
        return f"{mean:.2f} ± {half:.2f}"

    assert (
        lines[1]
        == "| FedIT | `fedavg` | — | 22.40 | — | — | — | 69.50 | — | — | — | 78.32 | — | — |"
    )
    summarization = f"{shown('feddpa-t', UNSEEN_AVG, 'summarization')} | 22.46 | "
    summarization += f"{shown('feddpa-t', UNSEEN_MAX, 'summarization')} | 22.65"
    assert lines[4].startswith(f"| FedDPA-T | `feddpa-t` | {summarization} | — | 71.88 | — |")
    assert lines[4].endswith(f"| {shown('feddpa-t', UNSEEN_MAX, 'open_domain_qa')} | 79.92 |")
    assert "- Reading Comprehension AVG: unseen task `reading_comprehension` is in no run" in text
    numbers = paper_table_numbers(document, {}, {SETUP: table})
    cell = numbers["rows"][2]["cells"]["Open Domain QA MAX"]
    assert cell["block"] == UNSEEN_MAX and cell["paper"] == 79.61 and cell["mean"] is None
    fedlora = numbers["rows"][1]["cells"]["Open Domain QA MAX"]
    assert fedlora["mean"] == pytest.approx(expected["fedavg-ft", UNSEEN_MAX, "open_domain_qa"][0])


def test_feddpa_t14_declares_the_papers_figures_and_stand_in() -> None:
    table = load_table("feddpa-t14")
    assert [r.label for r in table.rows] == ["fedavg", "fedavg-ft", "feddpa-f", "feddpa-t"]
    assert [c.block for c in table.columns] == [UNSEEN_AVG, UNSEEN_MAX] * 3
    assert table.rows[0].paper == (22.40, None, 69.50, None, 78.32, None)  # FedIT: AVG only
    assert table.rows[3].paper == (22.46, 22.65, 71.88, 76.00, 78.76, 79.92)
    assert [c.task_of(True) for c in table.columns[::2]] == [
        "summarization",
        "text_formatting",
        "word_sorting",
    ]
    stand_in = _config({"num-clients": 0, **_setup("instructions-unseen-tasks")})
    assert set(stand_in.unseen_task_names) == {c.task_of(True) for c in table.columns}


def _setup(name: str) -> dict:
    import tomllib

    from fedfm_flower.config.files import CONFIG_ROOT

    return tomllib.loads((CONFIG_ROOT / "setups" / f"{name}.toml").read_text())


TABLE = """paper = "P"
table = "Table 14"
title = "unseen"
metric = "rouge"
reference = "local"
[[columns]]
name = "S AVG"
setup = "sa"
task = "sum"
block = "Unseen tasks (AVG)"
[[rows]]
name = "Local"
method = "local"
"""


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('task = "sum"', 'task = "Average"', "has a column per unseen task and no 'Average'"),
        (  # the block moved from the column to the row
            'block = "Unseen tasks (AVG)"\n[[rows]]\nname = "Local"\nmethod = "local"',
            '[[rows]]\nname = "Local"\nmethod = "local"\nblock = "Unseen tasks (MAX)"',
            "row 0 .Local.: 'block' = 'Unseen tasks .MAX.' is a column's, not a row's",
        ),
        (
            'block = "Unseen tasks (AVG)"',
            'block = "Unseen tasks"',
            "unknown 'block' 'Unseen tasks'; known: .*Unseen tasks .AVG.",
        ),
    ],
)
def test_bad_unseen_declarations_are_refused(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    """An unseen column names an unseen task (no Average), only columns name an unseen block,
    and an unknown block lists the unseen ones: each refused naming the file."""
    (tmp_path / "tables").mkdir()
    (tmp_path / "tables" / "t.toml").write_text(TABLE.replace(old, new))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "tables" / "t.toml"))) as err:
        load_table("t", tmp_path)
    assert re.search(message, str(err.value)), err.value
