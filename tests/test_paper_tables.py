"""The papers' tables by name: every declared row resolves on the paper's setting and on its
offline stand-in (config checks only: no run, no download), a table's pFedSeq cell is the
config users run, bad declarations are refused, and the report lays a table out as the paper,
its cells from the main table or, for client-task columns (FedDPA's Table 1), from the per-task
table."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.config.files import CONFIG_ROOT
from fedfm_flower.data.flan import flan_client_task
from fedfm_flower.data.instructions import client_task
from fedfm_flower.methods.registry import method_spec
from fedfm_flower.models.vit_parts import VIT_PARTS
from fedfm_flower.report.build import main as report_main
from fedfm_flower.report.task_table import UNSEEN_BLOCKS
from fedfm_flower.study.paper_tables import (
    PaperTable,
    load_table,
    read_table,
    record_table,
    table_names,
)
from fedfm_flower.study.sweep import build_cells, cell_config
from fedfm_flower.study.sweep import main as sweep_main
from tests.report_runs import write_run_dir

TABLES = table_names()


def test_the_papers_main_tables_are_declared() -> None:
    assert {"pfedseq-t1", "feddpa-t1"} <= set(TABLES)


def _users_data(table: PaperTable, setup: str, stand_in: bool, root: Path) -> dict[str, str]:
    """Overrides standing in for the data a user provides: a setup naming a ``flan`` data-dir
    that is not here (the authors' files) gets tiny client files under ``root``, one per
    client, each client's records of the task the table's columns name (columns in client
    order), and data-dir pointing at them (an unseen-test-dir that is not here: a tiny file per
    unseen column's task); one naming an image copy that is not here (pFedPG's
    Office-Caltech10) gets an empty directory, all the config check reads. Preflight itself
    still refuses a missing directory."""
    config = cell_config(table.labels()[0], setup, 0, root)
    columns = [c for c in table.columns if c.setup_of(stand_in) == setup]
    unseen = {}
    if config.get("unseen-test-dir") and not Path(config["unseen-test-dir"]).is_dir():
        # the unseen tasks' test files (feddpa-t14): one tiny file per unseen column's task
        unseen_dir = root / "unseen" / setup
        unseen_dir.mkdir(parents=True)
        for task in dict.fromkeys(c.task_of(stand_in) for c in columns if c.block in UNSEEN_BLOCKS):
            record = {"instruction": "Question?", "output": "yes", "category": task}
            (unseen_dir / f"{task}.json").write_text(json.dumps([record]))
        unseen = {"unseen-test-dir": str(unseen_dir)}
    if not config.get("data-dir") or Path(config["data-dir"]).is_dir():
        return unseen
    if config.get("dataset") != "flan":
        (root / "images" / setup).mkdir(parents=True)
        return {"data-dir": str(root / "images" / setup)}
    tasks = [c.task_of(stand_in) for c in columns if c.block not in UNSEEN_BLOCKS]
    tasks = [t for t in tasks if t and t != "Average"]
    data = root / "flan" / setup
    data.mkdir(parents=True)
    for client in range(int(config["num-clients"])):
        task = tasks[client] if client < len(tasks) else f"task-{client}"
        record = {"instruction": f"Question {client}?", "output": "yes", "category": task}
        for name in ("local_training", "local_test"):
            (data / f"{name}_{client}.json").write_text(json.dumps([record]))
    return {"data-dir": str(data), **unseen}


@pytest.mark.parametrize("name", TABLES)
@pytest.mark.parametrize("stand_in", [False, True])
def test_every_row_resolves_on_every_column(name: str, stand_in: bool, tmp_path: Path) -> None:
    table = load_table(name)
    for label in table.labels():
        method_spec(label.partition(":")[0])  # a registered method (KeyError names it)
    # build_cells validates every cell's run config (ValueError names the run and the value)
    cells = []
    runs = table.runs(stand_in)
    for setup in table.setups(stand_in):
        overrides = _users_data(table, setup, stand_in, tmp_path)
        cells += build_cells(table.labels(), [setup], [0], tmp_path, overrides, only=set(runs))
    assert sorted((c.setup, c.label) for c in cells) == sorted(runs)
    if stand_in:  # offline: small models built here, nothing from the Hub
        assert all(not c.config.get("pretrained", False) for c in cells), name


def test_a_missing_users_data_dir_is_still_refused(tmp_path: Path) -> None:
    """The paper's FedDPA setting names the authors' data directory: where it is not, preflight
    refuses the cell before any run (the test above provides tiny files instead)."""
    table = load_table("feddpa-t1")
    data_dir = cell_config("fedavg", "feddpa-flan-dataset1", 0, tmp_path)["data-dir"]
    if Path(data_dir).exists():
        pytest.skip(f"{data_dir} is here (the user's copy of the authors' data)")
    with pytest.raises(ValueError, match="'data-dir' = 'data/dataset1/8'.*no such directory"):
        build_cells(table.labels(), table.setups(), [0], tmp_path)


@pytest.mark.parametrize(
    ("name", "setup", "alpha"),
    [("feddpa-t1", "feddpa-flan-dataset1", 0.5), ("feddpa-t2", "feddpa-flan-dataset2", 0.3)],
)
def test_feddpa_task_columns_are_the_federations_client_tasks(
    name: str, setup: str, alpha: float, tmp_path: Path
) -> None:
    """Each setting's task columns name its 8 clients' tasks once each (plus Average): the flan
    loader's names (a client's most common category) on the paper's setting, the offline
    instructions tasks on the stand-in; the paper's setting is the paper's, FedDPA-T's alpha
    the dataset's (sec. 5.1)."""
    table = load_table(name)
    assert [c.name for c in table.columns][-1] == "Average"
    assert [r.block for r in table.rows].count("Personalization") == 6
    ttp = [r.name for r in table.rows if r.block == "Test-time personalization"]
    assert ttp == ["Local-finetuned", "FedLoRA", "FedDPA-F", "FedDPA-T"]
    for stand_in in (False, True):
        tasks = [c.task_of(stand_in) for c in table.columns[:-1]]
        assert len(set(tasks)) == 8, stand_in
    assert {client_task(i) for i in range(8)} == {c.task_of(True) for c in table.columns[:-1]}
    data = Path(_users_data(table, setup, False, tmp_path)["data-dir"])
    assert [flan_client_task(str(data), i) for i in range(8)] == [
        c.task for c in table.columns[:-1]
    ]
    for label in table.labels():
        cell = cell_config(label, setup, 0, tmp_path)
        assert (cell["dataset"], cell["num-clients"], cell["fraction-train"]) == ("flan", 8, 1.0)
        assert cell["model-name-or-path"] == "huggyllama/llama-7b"
        assert (cell["lora-rank"], cell["lora-target-modules"]) == (8, "q_proj,v_proj")
        assert (cell["local-epochs"], cell["batch-size"]) == (10, 32)
        assert cell["test-time-evaluation"] is True
        # K = 20 rounds; Local-finetuned and Centralized: 50 epochs (Appendix A.2)
        epochs = 50 if label in ("local", "centralized") else 200
        assert cell["num-server-rounds"] * cell["local-epochs"] == epochs, label
    assert cell_config("feddpa-t", setup, 0, tmp_path)["feddpa-alpha"] == alpha


def test_pfedseq_cells_are_the_configs_users_run(tmp_path: Path) -> None:
    """The table's pFedSeq cell on each paper column sets every key of the user's config file
    (configs/pfedseq/<dataset>-vit-b16.toml) to the same value."""
    files = {
        "pfedseq-cifar100": "cifar100-vit-b16",
        "pfedseq-tiny-imagenet": "tiny-imagenet-vit-b16",
        "pfedseq-domainnet": "domainnet-vit-b16",
        "pfedseq-omniglot": "omniglot-vit-b16",
    }
    assert set(load_table("pfedseq-t1").setups()) == set(files)
    for setup, stem in files.items():
        users = tomllib.loads((CONFIG_ROOT / "pfedseq" / f"{stem}.toml").read_text())
        cell = cell_config("pfedseq", setup, 0, tmp_path)
        assert {k: cell.get(k) for k in users} == users, setup
        baseline = cell_config("fedavg", setup, 0, tmp_path)  # the shared setting, no pfedseq key
        assert not any(k.startswith("pfedseq-") for k in baseline)
        shared = {k: v for k, v in users.items() if not k.startswith("pfedseq-") and k != "method"}
        assert {k: baseline.get(k) for k in shared} == shared, setup


def test_peradas_cells_distil_on_cifar10_as_pfedseq_and_the_stand_in_on_its_public_split(
    tmp_path: Path,
) -> None:
    """pFedSeq's Appendix B: PerAda's KD runs on CIFAR-10 on every dataset of Table 1; the
    offline stand-in has no CIFAR-10 and keeps the run dataset's public split (the default)."""
    table = load_table("pfedseq-t1")
    for setup in table.setups():
        assert cell_config("perada", setup, 0, tmp_path)["perada-aux-data"] == "cifar10", setup
    for setup in table.setups(stand_in=True):
        assert "perada-aux-data" not in cell_config("perada", setup, 0, tmp_path), setup


@pytest.mark.parametrize("method", ["pfedpg", "fedvpt", "fedvpt-deep"])
def test_pfedpg_cells_are_the_configs_users_run(method: str, tmp_path: Path) -> None:
    """pFedPG's Table 2 cells of the prompt methods set every key of the user's config file
    (configs/<method>/cifar100-<partition>-vit-b16.toml) to the same value; the CIFAR-10 cells
    set the same keys but the dataset's own (dataset; for the disjoint column, classes per
    client and partitioner)."""
    files = {"pfedpg-cifar100-dir0.1": "cifar100-dir0.1-vit-b16"}
    files["pfedpg-cifar100-disjoint"] = "cifar100-disjoint-vit-b16"
    cifar10 = {"pfedpg-cifar10-dir0.1": "pfedpg-cifar100-dir0.1"}
    cifar10["pfedpg-cifar10-disjoint"] = "pfedpg-cifar100-disjoint"
    assert set(load_table("pfedpg-t2").setups()) == {*cifar10, *files}
    for setup, stem in files.items():
        users = tomllib.loads((CONFIG_ROOT / method / f"{stem}.toml").read_text())
        cell = cell_config(method, setup, 0, tmp_path)
        assert {k: cell.get(k) for k in users} == users, (method, setup)
    for setup, twin in cifar10.items():
        cell = cell_config(method, setup, 0, tmp_path)
        twin_cell = cell_config(method, twin, 0, tmp_path)
        differ = {k for k in cell.keys() | twin_cell.keys() if cell.get(k) != twin_cell.get(k)}
        # CIFAR-10's disjoint column: 2 classes a client, which cannot all be a client's own
        disjoint = {"classes-per-client", "partitioner"} if "disjoint" in setup else set()
        assert (
            cell["dataset"] == "cifar10" and differ == {"dataset", "setup", "run-name"} | disjoint
        )
        if disjoint:
            assert (cell["partitioner"], twin_cell["partitioner"]) == ("pathological", "disjoint")
        assert cell.get("classes-per-client", 2) == 2


def test_pfedpg_ablation_rows_set_the_keys_the_paper_varies(tmp_path: Path) -> None:
    """Table 5's row K runs K prompts on every column of both settings (the overlay wins over
    the setup's pFedPG file, which sets 10); Table 4's rows each run one generator, K = 10."""
    t5, t4 = load_table("pfedpg-t5"), load_table("pfedpg-t4")
    defaults = ExperimentConfig().to_run_config()

    def cell(label: str, setup: str) -> dict[str, object]:
        return {**defaults, **cell_config(label, setup, 0, tmp_path)}

    generators = {
        "pfedpg:basis-only": "basis",
        "pfedpg:mlp-generator": "mlp",
        "pfedpg:adain-generator": "adain",
        "pfedpg": "cross-attention",
    }
    assert t4.labels() == ["fedvpt", *generators]
    assert [r.name for r in t5.rows] == [f"K = {k}" for k in (1, 5, 10, 50, 100, 200)]
    for stand_in in (False, True):
        for row in t5.rows:
            k = int(row.name.removeprefix("K = "))
            for setup in t5.setups(stand_in):
                assert cell(row.label, setup)["vpt-num-prompts"] == k, (row.label, setup)
        for label, generator in generators.items():
            for setup in t4.setups(stand_in):
                keys = cell(label, setup)
                assert (keys["pfedpg-generator"], keys["vpt-num-prompts"]) == (generator, 10)


def test_pfedseq_t1_rows_in_the_papers_order() -> None:
    table = load_table("pfedseq-t1")
    assert [r.name for r in table.rows][:2] == ["Local", "FedAvg"]
    assert table.rows[-1].name == "pFedSeq" and table.rows[-1].paper == (95.30, 94.30, 84.63, 45.25)
    assert len(table.rows) == 13 and table.reference == "local"


def test_pfedseq_ablation_rows_change_only_the_key_the_paper_removes(tmp_path: Path) -> None:
    """pFedSeq's Tables 2-3: on each paper column a variant row's config is pFedSeq's with only
    its one key changed, the variant winning over the dataset's pfedseq file (L = 20 / 10,
    learner mamba)."""
    removed = {
        "pfedseq:variant-a": {"pfedseq-global-aggregation": False},
        "pfedseq:variant-b": {"pfedseq-seq-len": 1},
        "pfedseq:variant-c": {"pfedseq-cross-client": False},
        "pfedseq:variant-d": {"pfedseq-learner": "mlp"},
        "pfedseq:variant-e": {"pfedseq-learner": "lstm"},
    }
    t2, t3 = load_table("pfedseq-t2"), load_table("pfedseq-t3")
    assert t2.labels() == [*list(removed)[:3], "pfedseq"]
    assert t3.labels() == [*list(removed)[3:], "pfedseq"]
    for setup in t2.setups():
        full = cell_config("pfedseq", setup, 0, tmp_path)
        assert full["pfedseq-learner"] == "mamba"
        for label, keys in removed.items():
            cell = cell_config(label, setup, 0, tmp_path)
            changed = {k for k in {*cell, *full} if cell.get(k) != full.get(k)}
            assert changed <= {*keys, "label", "run-name"}, (label, setup, changed)
            assert {k: cell[k] for k in keys} == keys, (label, setup)


def test_fedperfix_t5_columns_change_only_the_vit(tmp_path: Path) -> None:
    """Table 5's ViT-Tiny and ViT-Base columns are Table 2's CIFAR-100 setting (its ViT-Small
    column) with another timm ViT, for every row: no other key of a cell differs."""
    table = load_table("fedperfix-t5")
    backbones = []
    for setup in table.setups():
        for label in table.labels():
            small = cell_config(label, "cifar100-dir0.1-vit-s16", 0, tmp_path)
            cell = cell_config(label, setup, 0, tmp_path)
            differ = {k for k in small.keys() | cell.keys() if small.get(k) != cell.get(k)}
            assert differ <= {"backbone", "setup", "run-name"}, (label, setup, differ)
        backbones.append(cell["backbone"])
    assert backbones == [f"vit_{size}_patch16_224" for size in ("tiny", "small", "base")]


def test_fedperfix_t3s_resnet50_column_changes_only_the_backbone(tmp_path: Path) -> None:
    """Table 3's ResNet50 column is its ViT-Small column's setting with the whole ResNet50 (and
    small-resnet for small-vit offline), row for row: FedBN keeps the ResNet's batch norms where
    the ViT's FedBN keeps its layer norms, no other key of a cell differs; FedPerfix has no
    ResNet cell, as the paper's "-", and the sweep runs it on the ViT column only."""
    table = load_table("fedperfix-t3")
    assert [c.name for c in table.columns] == ["ResNet50", "ViT-Small"]  # the paper's order
    assert [(r.name, table.missing_columns(r)) for r in table.missing()] == [
        ("FedPerfix", ["ResNet50"])
    ]
    for stand_in, backbone in ((False, "resnet50"), (True, "small-resnet")):
        resnet_setup, vit_setup = table.setups(stand_in)
        runs = table.runs(stand_in)
        assert (vit_setup, "fedperfix") in runs and (resnet_setup, "fedperfix") not in runs
        assert len(runs) == 2 * 7 + 1
        for row in table.rows:
            resnet_label, vit_label = row.labels
            if resnet_label is None:
                continue
            ours = cell_config(resnet_label, resnet_setup, 0, tmp_path)
            theirs = cell_config(vit_label, vit_setup, 0, tmp_path)
            differ = {k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)}
            allowed = {"backbone", "setup", "run-name", "label"}
            if row.name == "FedBN":
                assert (ours["fedperfix-personal"], theirs["fedperfix-personal"]) == (
                    "resnet.norm",
                    "vit.norm",
                )
                # No plugin (tuner none): the ViT stand-in's prefix size means nothing to it.
                assert ours["tuner"] == theirs["tuner"] == "none"
                allowed |= {"fedperfix-personal", "prefix-bottleneck"}
            assert differ <= allowed, (row.name, stand_in, differ)
            assert ours["backbone"] == backbone


def test_fedperfix_tables_agree_on_table_2s_cifar100_setting() -> None:
    """Where a FedPerfix table's column is Table 2's CIFAR-100 setting, each row's paper figure
    is Table 2's for the same method (the paper repeats that run in Tables 1 and 3-6)."""

    def figures(name: str) -> dict[str, float | None]:
        table = load_table(name)
        column = [c.setup for c in table.columns].index("cifar100-dir0.1-vit-s16")
        return {r.label: r.paper[column] for r in table.rows if r.label is not None}

    table_2 = figures("fedperfix-t2")
    for name in ("fedperfix-t1", "fedperfix-t3", "fedperfix-t4", "fedperfix-t5", "fedperfix-t6"):
        ours = figures(name)
        shared = ours.keys() & table_2.keys()
        assert shared and all(ours[k] == table_2[k] for k in shared), name


def test_fedperfix_t1_rows_keep_their_layer_type_local(tmp_path: Path) -> None:
    """Table 1's rows keep exactly the paper's layer type local, with the head in a combined
    row, and no plugin, on both settings; a row whose run is one of Table 2's under another
    label (every key but the label the same) has Table 2's figure (FedBN, Vanilla Attention)."""
    parts = {
        "Patch Embedding": "vit.patch-embed",
        "Position Embedding": "vit.pos-embed",
        "LayerNorm": "vit.norm",
        "Self-attention": "vit.attn",
        "MLP": "vit.mlp",
    }
    assert {*parts.values(), "vit.cls-token"} == set(VIT_PARTS)  # the paper leaves the tokens
    expected = {"Classification Head": {"head"}}
    for name, group in parts.items():
        expected |= {f"{name} (stand-alone)": {group}, f"{name} (combined)": {group, "head"}}
    table = load_table("fedperfix-t1")
    rows = {r.name: r for r in table.rows if r.label and r.label.startswith("fedperfix:")}
    assert list(rows) == list(expected)
    for stand_in in (False, True):
        (setup,) = table.setups(stand_in)
        for name, row in rows.items():
            cell = cell_config(row.label, setup, 0, tmp_path)
            personal = {p.strip() for p in cell["fedperfix-personal"].split(",")}
            assert (cell["tuner"], personal) == ("none", expected[name]), (name, setup)

    def run(label: str) -> dict:
        cell = cell_config(label, "cifar100-dir0.1-vit-s16", 0, tmp_path)
        return {k: v for k, v in cell.items() if k not in ("label", "run-name")}

    table_2 = [r for r in load_table("fedperfix-t2").rows if r.label]
    same = [
        (r.paper[0], t.paper[0])
        for r in rows.values()
        for t in table_2
        if run(r.label) == run(t.label)
    ]
    assert len(same) == 2 and all(a == b for a, b in same), same


def _declare(root: Path, text: str) -> None:
    (root / "tables").mkdir(parents=True, exist_ok=True)
    (root / "tables" / "t.toml").write_text(text)


GOOD = """paper = "P"
table = "Table 9"
title = "t"
metric = "acc"
reference = "local"
[[columns]]
name = "A"
setup = "sa"
stand-in = "ga"
[[rows]]
name = "Local"
method = "local"
paper = [1.5]
[[rows]]
name = "Other"
missing = "not written"
"""


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('[[columns]]\nname = "A"\nsetup = "sa"\nstand-in = "ga"\n', ""), r"no \[\[columns\]\]"),
        (('missing = "not written"', 'method = "x"\nmissing = "y"'), "exactly where a cell"),
        (('missing = "not written"', ""), "exactly where a cell"),
        (('method = "local"', 'method = "local"\nmethods = ["local"]'), "'method' .every col"),
        (('method = "local"', 'methods = ["local", "x"]'), "one label per column .1."),
        (('method = "local"', "methods = [1]"), "a label, or"),
        (('method = "local"', 'methods = [""]'), "names no method"),
        (('missing = "not written"', 'methods = [""]\nmissing = "y"'), "names no method"),
        (('missing = "not written"', 'method = "local"'), "two rows of column 'A'"),
        (("paper = [1.5]", "paper = [1.5, 2.0]"), "one figure per column"),
        (("paper = [1.5]", 'paper = ["a"]'), "a number"),
        (('reference = "local"', 'reference = "fedavg"'), "reference 'fedavg'"),
        (('setup = "sa"', 'setup = ""'), "'setup' must be"),
    ],
)
def test_bad_declarations_are_refused(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    _declare(tmp_path, GOOD.replace(*change))
    with pytest.raises(ValueError, match=message):
        load_table("t", tmp_path)


def test_a_good_declaration_and_its_record(tmp_path: Path) -> None:
    _declare(tmp_path, GOOD)
    table = load_table("t", tmp_path)
    assert table.labels() == ["local"] and [r.name for r in table.missing()] == ["Other"]
    assert table.setups() == ["sa"] and table.setups(stand_in=True) == ["ga"]
    with pytest.raises(ValueError, match="no table 'u' .declared: t."):
        load_table("u", tmp_path)
    out = tmp_path / "out"
    record_table(out, table, stand_in=True)
    record_table(out, table, stand_in=True)  # the same table again: fine (a resumed sweep)
    assert read_table(out)["setting"] == "stand-in"
    with pytest.raises(ValueError, match="holds table t .stand-in setting."):
        record_table(out, table, stand_in=False)
    (out / "table.json").write_text("{")
    with pytest.raises(ValueError, match="not a table record"):
        read_table(out)


def test_sweep_refuses_a_table_beside_methods_or_an_unknown_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sweep_main(["--table", "pfedseq-t1", "--methods", "local", "--out", str(tmp_path)]) == 2
    assert "drop --methods/--setups" in capsys.readouterr().err
    assert sweep_main(["--table", "nope", "--out", str(tmp_path)]) == 2
    assert "no table 'nope'" in capsys.readouterr().err
    assert sweep_main(["--methods", "local", "--out", str(tmp_path)]) == 2
    assert "give --methods and --setups, or --table" in capsys.readouterr().err
    assert not (tmp_path / "table.json").exists()


def test_report_lays_the_table_out_as_the_paper(tmp_path: Path) -> None:
    """Rows and columns in the declared order, ours beside the paper's figures, missing rows
    named; on stand-ins, no paper figures beside ours."""
    _declare(
        tmp_path / "configs",
        GOOD.replace(
            '[[rows]]\nname = "Other"',
            '[[rows]]\nname = "Fed"\nmethod = "fedavg"\npaper = [2.5]\n[[rows]]\nname = "Other"',
        ),
    )
    table = load_table("t", tmp_path / "configs")
    runs = tmp_path / "runs"
    for seed in (0, 1):
        write_run_dir(runs / "a", "local", seed, [0.5, 0.7], setup="sa")
        write_run_dir(runs / "b", "fedavg", seed, [0.6 + 0.1 * seed, 0.8], setup="sa")
    record_table(runs, table, stand_in=False)
    out = tmp_path / "report"
    assert report_main([str(runs), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    section = text[text.index("## P, Table 9: t") :]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0] == "| row | method | A (`sa`) | paper |"
    assert lines[1].startswith("| Local | `local` | 60.00 ± ") and lines[1].endswith("| 1.50 |")
    assert lines[2].startswith("| Fed | `fedavg` | 72.50 ± ") and lines[2].endswith("| 2.50 |")
    assert lines[3] == "| Other | not here | — | — |"
    assert "- Other: not written" in section
    numbers = json.loads((out / "report.json").read_text())["paper-table"]
    fed = numbers["rows"][1]["cells"]["A"]
    assert fed["mean"] == pytest.approx(72.5) and fed["paper"] == 2.5 and fed["seeds"] == [0, 1]
    (runs / "table.json").unlink()
    record_table(runs, table, stand_in=True)  # same runs read as stand-ins: setup names differ
    assert report_main([str(runs), "--out", str(out)]) == 0
    section = (out / "report.md").read_text().split("## P, Table 9: t")[1]
    assert "| row | method | A (`ga`) |" in section and "| paper |" not in section
    assert "| Local | `local` | — |" in section  # no run on the stand-in's setup


PER_COLUMN = """paper = "P"
table = "Table 3"
title = "backbones"
metric = "acc"
reference = "local"
[[columns]]
name = "CNN"
setup = "sa"
stand-in = "ga"
[[columns]]
name = "ViT"
setup = "sb"
stand-in = "gb"
[[rows]]
name = "Local"
method = "local"
paper = [1.5, 2.5]
[[rows]]
name = "Norms"
methods = ["fedavg:cnn", "fedavg"]
paper = [3.5, 4.5]
[[rows]]
name = "Ours"
methods = ["", "fedrep"]
missing = "a ViT method"
paper = ["", 5.5]
"""


def test_a_row_names_a_method_per_column_and_the_sweep_runs_only_those_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A row's ``methods`` give each column its own label (``""``: none, the row's ``missing``
    says why): the table's runs are exactly the declared (setup, label) cells, which the sweep
    builds and nothing more, and the plan names the column a row lacks."""
    _declare(tmp_path, PER_COLUMN)
    table = load_table("t", tmp_path)
    assert [row.labels for row in table.rows] == [
        ("local", "local"),
        ("fedavg:cnn", "fedavg"),
        (None, "fedrep"),
    ]
    assert [row.label for row in table.rows] == ["local", None, None]
    assert table.labels() == ["local", "fedavg:cnn", "fedavg", "fedrep"]
    assert table.runs(stand_in=True) == [
        ("ga", "local"),
        ("gb", "local"),
        ("ga", "fedavg:cnn"),
        ("gb", "fedavg"),
        ("gb", "fedrep"),
    ]
    assert [(r.name, table.missing_columns(r)) for r in table.missing()] == [("Ours", ["CNN"])]

    built: list[tuple[str, str, int]] = []

    def build(labels, setups, seeds, out, overrides, tag, configs, only=None):  # noqa: ANN001, ANN202
        built.extend(
            (s, label, seed)
            for s in setups
            for label in labels
            if (s, label) in only
            for seed in seeds
        )
        raise ValueError("stop before running")

    monkeypatch.setattr("fedfm_flower.study.sweep.build_cells", build)
    argv = ["--table", "t", "--configs", str(tmp_path), "--seeds", "0", "1", "--out"]
    assert sweep_main([*argv, str(tmp_path / "out")]) == 2
    plan = capsys.readouterr().out
    assert "not run: Ours (CNN): a ViT method" in plan
    assert sorted(built) == sorted((s, label, seed) for s, label in table.runs() for seed in (0, 1))
    assert ("sa", "fedavg", 0) not in built and ("sa", "fedrep", 0) not in built


def test_the_report_takes_each_cell_from_its_columns_method(tmp_path: Path) -> None:
    """A per-column row's cells are its column's method's runs on the column's setup (another
    column's method on that setup is not the row's, though it ran); its lacking column shows a
    dash and is named below the table."""
    _declare(tmp_path / "configs", PER_COLUMN)
    table = load_table("t", tmp_path / "configs")
    runs = tmp_path / "runs"
    for seed in (0, 1):
        write_run_dir(runs / "a", "local", seed, [0.5, 0.7], setup="sa")
        write_run_dir(runs / "b", "local", seed, [0.5, 0.6], setup="sb")
        write_run_dir(runs / "c", "fedavg:cnn", seed, [0.6, 0.8 + 0.02 * seed], setup="sa")
        write_run_dir(runs / "d", "fedavg", seed, [0.6, 0.4 + 0.02 * seed], setup="sb")
        write_run_dir(runs / "e", "fedavg", seed, [0.6, 0.9], setup="sa")  # not the table's
        write_run_dir(runs / "f", "fedrep", seed, [0.6, 0.3 + 0.02 * seed], setup="sb")
    record_table(runs, table, stand_in=False)
    out = tmp_path / "report"
    assert report_main([str(runs), "--out", str(out)]) == 0
    section = (out / "report.md").read_text().split("## P, Table 3: backbones")[1]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0] == "| row | method | CNN (`sa`) | paper | ViT (`sb`) | paper |"
    assert lines[2].startswith("| Norms | `fedavg:cnn` / `fedavg` | 70.50 ± ")
    assert "| 3.50 | 50.50 ± " in lines[2] and lines[2].endswith("| 4.50 |")
    assert lines[3].startswith("| Ours | `fedrep` | — | — | 45.50 ± ")
    assert "- Ours (CNN): a ViT method" in section
    numbers = json.loads((out / "report.json").read_text())["paper-table"]["rows"]
    cnn, vit = numbers[1]["cells"]["CNN"], numbers[1]["cells"]["ViT"]
    assert (cnn["label"], vit["label"]) == ("fedavg:cnn", "fedavg")
    assert cnn["mean"] == pytest.approx(70.5) and vit["mean"] == pytest.approx(50.5)
    assert numbers[2]["cells"]["CNN"]["mean"] is None


def test_the_report_tests_against_the_tables_reference_unless_told(tmp_path: Path) -> None:
    fed_row = '[[rows]]\nname = "Fed"\nmethod = "fedavg"\npaper = [2.5]\n[[rows]]\nname = "Other"'
    declared = GOOD.replace('[[rows]]\nname = "Other"', fed_row)
    _declare(tmp_path / "configs", declared.replace('reference = "local"', 'reference = "fedavg"'))
    runs = tmp_path / "runs"
    for seed in (0, 1):
        write_run_dir(runs / "a", "local", seed, [0.5, 0.7], setup="sa")
        write_run_dir(runs / "b", "fedavg", seed, [0.6 + 0.1 * seed, 0.8], setup="sa")
    record_table(runs, load_table("t", tmp_path / "configs"), stand_in=False)
    out = tmp_path / "report"
    assert report_main([str(runs), "--out", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["reference"] == "fedavg"
    assert report_main([str(runs), "--out", str(out), "--reference", "local"]) == 0
    assert json.loads((out / "report.json").read_text())["reference"] == "local"


TASKS = """paper = "P"
table = "Table 7"
title = "tasks"
metric = "rouge"
reference = "local"
[[columns]]
name = "QA"
setup = "sa"
stand-in = "ga"
task = "qa"
[[columns]]
name = "Summaries"
setup = "sa"
stand-in = "ga"
task = "sum"
stand-in-task = "dialogue"
[[columns]]
name = "Average"
setup = "sa"
stand-in = "ga"
task = "Average"
[[rows]]
name = "Local"
method = "local"
block = "Personalization"
paper = [1.5, 2.5, 2.0]
[[rows]]
name = "Fed"
method = "fedavg"
block = "Personalization"
[[rows]]
name = "Other"
missing = "not written"
block = "Personalization"
[[rows]]
name = "Local"
method = "local"
block = "Test-time personalization"
paper = [3.0, "", 3.0]
"""


@pytest.mark.parametrize(
    ("text", "change", "message"),
    [
        (TASKS, ('block = "Test-time personalization"', ""), "row 3 .Local.: the columns are "),
        (TASKS, ('block = "Personalization"\npaper', 'block = "Personal"\npaper'), "unknown "),
        (TASKS, ('task = "qa"', ""), "columns QA name no 'task'"),
        (TASKS, ('task = "sum"', ""), "'stand-in-task' needs the column's 'task'"),
        (TASKS, ('block = "Test-time personalization"', 'block = "Personalization"'), "one bl"),
        (GOOD, ('method = "local"', 'method = "local"\nblock = "Personalization"'), "needs col"),
    ],
)
def test_bad_task_declarations_are_refused_naming_the_file(
    tmp_path: Path, text: str, change: tuple[str, str], message: str
) -> None:
    """A task column without a row's block, an unknown block, columns half tasks, a block
    without task columns: each refused with the file named."""
    _declare(tmp_path, text.replace(*change))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "tables" / "t.toml"))) as err:
        load_table("t", tmp_path)
    assert re.search(message, str(err.value)), err.value


# final per-client values: method -> seed -> (client 0, client 1); client 0's task is "sum" and
# client 1's "qa", so the columns (qa first) are matched by name, not by client order
ROUGE = {"local": {0: (0.60, 0.90), 1: (0.64, 0.80)}, "fedavg": {0: (0.50, 0.70), 1: (0.56, 0.76)}}
TTP = {"local": {0: (0.40, 0.45), 1: (0.42, 0.49)}, "fedavg": {0: (0.66, 0.68), 1: (0.70, 0.60)}}


def _write_task_run(root: Path, label: str, seed: int, setup: str) -> None:
    """A finished run with per-client ROUGE-1 and TTP, as the runner writes it (2 rounds, the
    last one counts), its clients' tasks stored by partition."""
    path = root / f"{label}-{setup}-s{seed}"
    path.mkdir(parents=True)
    run_config = {"method": label, "label": label, "setup": setup, "dataset": "flan", "seed": seed}
    payload = {"run-config": run_config, "client-tasks": {"0": "sum", "1": "qa"}}
    (path / "config.json").write_text(json.dumps(payload))
    records = []
    for server_round in (1, 2):
        shift = 0.3 if server_round == 1 else 0.0
        evaluate = {
            str(900 + c): {
                "client-id": float(c),
                "num-examples": 10.0,
                "test-rouge-1": ROUGE[label][seed][c] - shift,
                "test-ttp-rouge-1": TTP[label][seed][c] - shift,
            }
            for c in (0, 1)
        }
        record = {"round": server_round, "bytes-down": 10, "bytes-up": 5, "clients-reported": 2}
        records.append({**record, "evaluate": evaluate})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "summary.json").write_text(json.dumps({"primary-metric": "rouge-1"}))


def _by_hand(values: list[float]) -> tuple[float, float]:
    """Mean and 95% half-width over seeds (scipy's t interval), in percent."""
    scaled = [100 * v for v in values]
    low, high = stats.t.interval(
        0.95, len(scaled) - 1, loc=np.mean(scaled), scale=stats.sem(scaled)
    )
    return float(np.mean(scaled)), (high - low) / 2


def _reported_rows(
    tmp_path: Path,
    table: PaperTable,
    labels: Iterable[str],
    write_run: Callable,
    setup: str,
    heading: str,
) -> tuple[str, list[str]]:
    """Runs of every label at seeds 0 and 1 (``write_run``) recorded as ``table``'s under
    ``tmp_path/runs``, reported to ``tmp_path/report``: the report's section under ``heading``
    and its table rows."""
    runs = tmp_path / "runs"
    for label in labels:
        for seed in (0, 1):
            write_run(runs, label, seed, setup)
    record_table(runs, table, stand_in=False)
    out = tmp_path / "report"
    assert report_main([str(runs), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    section = text[text.index(heading) :].split("\n## ")[0]
    return section, [line for line in section.splitlines() if line.startswith("| ")]


def test_report_lays_a_task_column_table_out_as_the_paper(tmp_path: Path) -> None:
    """Each cell is the per-task table's (block, method, task) of the column's setup, computed
    here by hand from the runs' per-client metrics; rows under their block; a declared task no
    client has is named with the tasks found."""
    _declare(tmp_path / "configs", TASKS)
    table = load_table("t", tmp_path / "configs")
    assert table.labels() == ["local", "fedavg"]
    out = tmp_path / "report"
    section, lines = _reported_rows(
        tmp_path, table, ROUGE, _write_task_run, "sa", "## P, Table 7: tasks"
    )
    assert lines[0] == (
        "| row | method | QA (`qa`) | paper | Summaries (`sum`) | paper | Average | paper |"
    )
    expected = {}
    for block, source in (("Personalization", ROUGE), ("Test-time personalization", TTP)):
        for label, by_seed in source.items():
            qa = [by_seed[s][1] for s in (0, 1)]  # client 1's task
            summaries = [by_seed[s][0] for s in (0, 1)]
            average = [(a + b) / 2 for a, b in zip(qa, summaries, strict=True)]
            expected[block, label] = [_by_hand(qa), _by_hand(summaries), _by_hand(average)]

    def shown(block: str, label: str, paper: list[str]) -> str:
        cells = [f"{m:.2f} ± {h:.2f}" for m, h in expected[block, label]]
        return " | ".join(f"{c} | {p}" for c, p in zip(cells, paper, strict=True))

    assert lines[1] == "| *Personalization* |" + " |" * 7
    assert (
        lines[2]
        == f"| Local | `local` | {shown('Personalization', 'local', ['1.50', '2.50', '2.00'])} |"
    )
    assert lines[3] == f"| Fed | `fedavg` | {shown('Personalization', 'fedavg', ['—'] * 3)} |"
    assert lines[4] == "| Other | not here | — | — | — | — | — | — |"
    assert lines[5] == "| *Test-time personalization* |" + " |" * 7
    ttp = shown("Test-time personalization", "local", ["3.00", "—", "3.00"])
    assert lines[6] == f"| Local | `local` | {ttp} |"
    assert "- Other (Personalization): not written" in section
    assert "Columns without a client" not in section
    numbers = json.loads((out / "report.json").read_text())["paper-table"]
    assert [(r["name"], r["block"]) for r in numbers["rows"]][-1] == (
        "Local",
        "Test-time personalization",
    )
    fed = numbers["rows"][1]["cells"]["Average"]
    mean, half = expected["Personalization", "fedavg"][2]
    assert fed["task"] == "Average" and fed["seeds"] == [0, 1] and fed["paper"] is None
    assert (fed["mean"], fed["ci95"]) == (pytest.approx(mean), pytest.approx(half))

    # the same runs as stand-ins on setup ga, whose Summaries column names task "dialogue"
    stand_in_runs = tmp_path / "stand-in-runs"
    for label in ROUGE:
        for seed in (0, 1):
            _write_task_run(stand_in_runs, label, seed, "ga")
    record_table(stand_in_runs, table, stand_in=True)
    assert report_main([str(stand_in_runs), "--out", str(out)]) == 0
    section = (out / "report.md").read_text().split("## P, Table 7: tasks")[1].split("\n## ")[0]
    assert "| row | method | QA (`qa`) | Summaries (`dialogue`) | Average |" in section
    (qa_mean, qa_half), _, (mean, half) = expected["Personalization", "local"]
    assert f"| Local | `local` | {qa_mean:.2f} ± {qa_half:.2f} | — | {mean:.2f} ± {half:.2f} |" in (
        section
    )
    assert (
        "- Summaries: task `dialogue` is no client's task in the runs on `ga` (their tasks: "
        "`sum`, `qa`)" in section
    )


# FedDPA's ablation layout (feddpa-t3): the columns name their blocks (and two setups), the rows
# none
COLUMN_BLOCKS = """paper = "P"
table = "Table 3"
title = "ablation"
metric = "rouge"
reference = "local"
[[columns]]
name = "D1 P"
setup = "sa"
stand-in = "ga"
task = "Average"
block = "Personalization"
[[columns]]
name = "D1 TTP"
setup = "sa"
stand-in = "ga"
task = "Average"
block = "Test-time personalization"
[[columns]]
name = "D2 TTP"
setup = "sb"
stand-in = "ga"
task = "qa"
block = "Test-time personalization"
[[rows]]
name = "Local"
method = "local"
paper = [1.0, 2.0, 3.0]
[[rows]]
name = "Fed"
method = "fedavg"
"""


@pytest.mark.parametrize(
    ("text", "change", "message"),
    [
        (COLUMN_BLOCKS, ('block = "Personalization"', ""), "columns D1 P name no 'block' while"),
        (
            COLUMN_BLOCKS,
            ('method = "fedavg"', 'method = "fedavg"\nblock = "Personalization"'),
            "row 1 .Fed.: 'block' = 'Personalization', but the columns name their blocks",
        ),
        (COLUMN_BLOCKS, ('block = "Personalization"', 'block = "P"'), "unknown 'block' 'P'"),
        (GOOD, ('stand-in = "ga"', 'stand-in = "ga"\nblock = "Personalization"'), "column's cl"),
    ],
)
def test_bad_column_blocks_are_refused_naming_the_column_or_row(
    tmp_path: Path, text: str, change: tuple[str, str], message: str
) -> None:
    """The blocks are all on the columns or all on the rows: a column without one beside
    columns with one, a row's block beside the columns', an unknown block, a block on a setup
    column: each refused with the file and the column or row named."""
    _declare(tmp_path, text.replace(*change))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "tables" / "t.toml"))) as err:
        load_table("t", tmp_path)
    assert re.search(message, str(err.value)), err.value


def test_report_takes_each_cell_from_its_columns_block_and_setup(tmp_path: Path) -> None:
    """With the blocks on the columns, a cell is the task table's (column's block, row's
    method, column's task) of the column's setup, computed here by hand; no block rows; a
    setup without the method's runs shows a dash."""
    _declare(tmp_path / "configs", COLUMN_BLOCKS)
    table = load_table("t", tmp_path / "configs")
    assert [r.block for r in table.rows] == [None, None]
    assert [c.block for c in table.columns][1:] == ["Test-time personalization"] * 2
    assert table.setups() == ["sa", "sb"] and table.setups(stand_in=True) == ["ga"]
    runs = tmp_path / "runs"
    for seed in (0, 1):
        for label in ROUGE:
            _write_task_run(runs, label, seed, "sa")
        _write_task_run(runs, "local", seed, "sb")  # no fedavg run on sb
    record_table(runs, table, stand_in=False)
    out = tmp_path / "report"
    assert report_main([str(runs), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    section = text[text.index("## P, Table 3: ablation") :].split("\n## ")[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0] == (
        "| row | method | D1 P (`Average` of `sa`, Personalization) | paper | D1 TTP (`Average` "
        "of `sa`, Test-time personalization) | paper | D2 TTP (`qa` of `sb`, Test-time "
        "personalization) | paper |"
    )

    def averages(source: dict, label: str) -> list[float]:
        return [sum(source[label][s]) / 2 for s in (0, 1)]

    def shown(mean_half: tuple[float, float]) -> str:
        return f"{mean_half[0]:.2f} ± {mean_half[1]:.2f}"

    local = [
        _by_hand(averages(ROUGE, "local")),
        _by_hand(averages(TTP, "local")),
        _by_hand([TTP["local"][s][1] for s in (0, 1)]),  # qa: client 1's task
    ]
    papers = ("1.00", "2.00", "3.00")
    cells = " | ".join(f"{shown(c)} | {p}" for c, p in zip(local, papers, strict=True))
    assert lines[1] == f"| Local | `local` | {cells} |"
    fed = [_by_hand(averages(ROUGE, "fedavg")), _by_hand(averages(TTP, "fedavg"))]
    assert lines[2] == (f"| Fed | `fedavg` | {shown(fed[0])} | — | {shown(fed[1])} | — | — | — |")
    assert "| *" not in section  # no block rows
    numbers = json.loads((out / "report.json").read_text())["paper-table"]
    ttp = numbers["rows"][0]["cells"]["D1 TTP"]
    assert ttp["block"] == "Test-time personalization" and numbers["rows"][0]["block"] is None
    assert ttp["mean"] == pytest.approx(local[1][0])


PAIRS = """paper = "Q"
table = "Table 1"
title = "pairs"
metric = "MSE"
reference = "tap"

[[columns]]
name = "FMNIST"
setup = "mv"
stand-in = "mc"
pair = "mse image-gen"

[[columns]]
name = "AG"
setup = "mv"
stand-in = "mc"
pair = "accuracy text-cls"

[[rows]]
name = "TAP"
method = "tap"
paper = [0.5467, 90.5]

[[rows]]
name = "Local"
method = "local"

[[rows]]
name = "Other"
missing = "not written"
"""
# final per-client values: method -> seed -> {client: {pair metric: value}}; client 0 holds
# image-gen, clients 1 and 2 text-cls (one seed's value: the mean over the clients holding it)
PAIR_VALUES = {
    "tap": {
        0: {
            0: {"mse-image-gen": 0.50},
            1: {"accuracy-text-cls": 0.80},
            2: {"accuracy-text-cls": 0.90},
        },
        1: {
            0: {"mse-image-gen": 0.56},
            1: {"accuracy-text-cls": 0.70},
            2: {"accuracy-text-cls": 0.75},
        },
    },
    "local": {
        0: {
            0: {"mse-image-gen": 0.62},
            1: {"accuracy-text-cls": 0.60},
            2: {"accuracy-text-cls": 0.64},
        },
        1: {
            0: {"mse-image-gen": 0.65},
            1: {"accuracy-text-cls": 0.58},
            2: {"accuracy-text-cls": 0.50},
        },
    },
}


def _write_pair_run(root: Path, label: str, seed: int, setup: str) -> None:
    """A finished multitask run whose clients report per-pair metrics (one round)."""
    path = root / f"{label}-{setup}-s{seed}"
    path.mkdir(parents=True)
    run_config = {"method": label, "label": label, "setup": setup, "dataset": "multitask"}
    (path / "config.json").write_text(json.dumps({"run-config": {**run_config, "seed": seed}}))
    clients = PAIR_VALUES[label][seed]
    evaluate = {
        str(900 + c): {
            "client-id": float(c),
            "num-examples": 10.0,
            "test-score": sum(m.values()),
            **{f"test-{k}": v for k, v in m.items()},
        }
        for c, m in clients.items()
    }
    record = {"round": 1, "bytes-down": 10, "bytes-up": 5, "clients-reported": 3}
    (path / "metrics.jsonl").write_text(json.dumps({**record, "evaluate": evaluate}) + "\n")
    (path / "summary.json").write_text(json.dumps({"primary-metric": "score"}))


def test_report_lays_a_pair_column_table_out_as_the_paper(tmp_path: Path) -> None:
    """Each cell is the pair table's (pair, method) of the column's setup, computed here by hand
    from the runs' per-client pair metrics: MSE raw with 4 decimals, accuracy x 100."""
    _declare(tmp_path / "configs", PAIRS)
    table = load_table("t", tmp_path / "configs")
    assert [c.pair_of(True) for c in table.columns] == ["mse image-gen", "accuracy text-cls"]
    assert all(r.block is None for r in table.rows)
    out = tmp_path / "report"
    section, lines = _reported_rows(
        tmp_path, table, PAIR_VALUES, _write_pair_run, "mv", "## Q, Table 1: pairs"
    )
    assert lines[0] == (
        "| row | method | FMNIST (`mse image-gen`) | paper | AG (`accuracy text-cls`) | paper |"
    )

    def by_hand(label: str, key: str, scale: float) -> tuple[float, float]:
        per_seed = []
        for seed in (0, 1):
            held = [m[key] for m in PAIR_VALUES[label][seed].values() if key in m]
            per_seed.append(scale * sum(held) / len(held))
        low, high = stats.t.interval(0.95, 1, loc=np.mean(per_seed), scale=stats.sem(per_seed))
        return float(np.mean(per_seed)), (high - low) / 2

    def shown(label: str, paper: list[str]) -> str:
        mse, mse_half = by_hand(label, "mse-image-gen", 1.0)
        acc, acc_half = by_hand(label, "accuracy-text-cls", 100.0)
        return f"{mse:.4f} ± {mse_half:.4f} | {paper[0]} | {acc:.2f} ± {acc_half:.2f} | {paper[1]}"

    assert lines[1] == f"| TAP | `tap` | {shown('tap', ['0.5467', '90.50'])} |"
    assert lines[2] == f"| Local | `local` | {shown('local', ['—', '—'])} |"
    assert lines[3] == "| Other | not here | — | — | — | — |"
    assert "Columns without a run" not in section
    numbers = json.loads((out / "report.json").read_text())["paper-table"]
    local = numbers["rows"][1]["cells"]["FMNIST"]
    mean, half = by_hand("local", "mse-image-gen", 1.0)
    assert local["pair"] == "mse image-gen" and local["seeds"] == [0, 1]
    assert (local["mean"], local["ci95"]) == (pytest.approx(mean), pytest.approx(half))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('pair = "mse image-gen"', 'pair = "mse image-cls2"'), "no row of the pair table"),
        (('pair = "mse image-gen"', 'pair = "mse"'), "no row of the pair table"),
        (('pair = "mse image-gen"', 'task = "x"'), "columns AG name no 'task'"),
        (('pair = "mse image-gen"', 'pair = "mse image-gen"\nstand-in-pair = "mse vqa"'), None),
        (('method = "local"', 'method = "local"\nblock = "Personalization"'), "needs col"),
    ],
)
def test_bad_pair_declarations_are_refused(
    tmp_path: Path, change: tuple[str, str], message: str | None
) -> None:
    """An unknown pair-table row, columns half pairs, a row's block: refused naming the file."""
    _declare(tmp_path, PAIRS.replace(*change))
    if message is None:
        assert load_table("t", tmp_path).columns[0].pair_of(True) == "mse vqa"
        return
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "tables" / "t.toml"))) as err:
        load_table("t", tmp_path)
    assert re.search(message, str(err.value)), err.value


def test_taps_ablation_rows_set_the_keys_the_paper_names(tmp_path: Path) -> None:
    """TAP's No-KD rows zero every beta of eq. 6; a margin row "low / high" sets the lower margin
    on image generation and text classification, the higher on the other two pair types, on
    both backbones (the variant wins over the setup's TAP file); the ViLT setting runs Table 22's
    ViLT margins."""
    from fedfm_flower.methods.tap import PAIR_TYPES

    def keys(label: str, setup: str, kind: str) -> dict[str, float]:
        cell = cell_config(label, setup, 0, tmp_path)
        return {t: cell[f"tap-{kind}-{t}"] for t in PAIR_TYPES if f"tap-{kind}-{t}" in cell}

    low = ("image-generation", "text-classification")
    for setup in ("multitask-flava", "multitask-vilt", "multitask-cpu"):
        assert keys("tap:no-kd", setup, "distill") == dict.fromkeys(PAIR_TYPES, 0.0)
        assert keys("tap", setup, "distill") == {}  # the defaults, beta > 0
        for name, m_low, m_high in (("0.01-0.04", 0.01, 0.04), ("0.05-0.1", 0.05, 0.1)):
            margins = keys(f"tap:margin-{name}", setup, "margin")
            assert margins == {t: m_low if t in low else m_high for t in PAIR_TYPES}, setup
    vilt = {"image-generation": 0.01, "text-classification": 0.01, "text-generation": 0.02}
    assert {t: keys("tap", "multitask-vilt", "margin")[t] for t in vilt} == vilt
    assert keys("tap", "multitask-flava", "margin") == {}  # Table 22's FLAVA column: the defaults
    for name in ("tap-t4", "tap-t5", "tap-t6"):
        assert [r.label for r in load_table(name).rows] == ["tap:no-kd", "tap"]


def test_tap_t14_to_t16_run_the_baselines_on_the_standard_backbone(tmp_path: Path) -> None:
    """Tables 14-16: every baseline row runs mm-backbone-routing = "shared" on every column's
    setting and stand-in (the variant wins over the setups), TAP its own architecture."""
    baselines = ["fedavg", "fedavg-ft", "per-fedavg", "per-fedavg-ft", "feddat", "feddat-ft"]
    for name in ("tap-t14", "tap-t15", "tap-t16"):
        table = load_table(name)
        assert table.labels() == [f"{m}:standard" for m in baselines] + ["tap"]
        for setup in {c.setup_of(s) for c in table.columns for s in (False, True)}:
            for label in table.labels():
                routing = cell_config(label, setup, 0, tmp_path).get("mm-backbone-routing")
                assert routing == (None if label == "tap" else "shared"), (name, setup, label)


def test_feddpa_t11s_13b_rows_change_only_the_checkpoint(tmp_path: Path) -> None:
    """On the paper's setting a 13B row is its 7B row with LLaMA-13B's weights, nothing else."""
    for method in ("feddpa-f", "feddpa-t"):
        small = cell_config(method, "feddpa-flan-dataset1", 0, tmp_path)
        large = cell_config(f"{method}:llama-13b", "feddpa-flan-dataset1", 0, tmp_path)
        changed = {k for k in small.keys() | large.keys() if small.get(k) != large.get(k)}
        assert changed == {"model-name-or-path", "label", "run-name"}, method
        assert large["model-name-or-path"] == "huggyllama/llama-13b"
