"""The papers' tables by name: every declared row resolves on the paper's setting and on its
offline stand-in (config checks only: no run, no download), a table's pFedSeq cell is the
config users run, bad declarations are refused, and the report lays a table out as the paper."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from fedfm_flower.config_files import CONFIG_ROOT
from fedfm_flower.paper_tables import load_table, read_table, record_table, table_names
from fedfm_flower.registry import method_spec
from fedfm_flower.report.build import main as report_main
from fedfm_flower.sweep import build_cells, cell_config
from fedfm_flower.sweep import main as sweep_main
from tests.report_runs import write_run_dir

TABLES = table_names()


def test_the_papers_main_tables_are_declared() -> None:
    assert "pfedseq-t1" in TABLES


@pytest.mark.parametrize("name", TABLES)
@pytest.mark.parametrize("stand_in", [False, True])
def test_every_row_resolves_on_every_column(name: str, stand_in: bool, tmp_path: Path) -> None:
    table = load_table(name)
    for label in table.labels():
        method_spec(label.partition(":")[0])  # a registered method (KeyError names it)
    # build_cells validates every cell's run config (ValueError names the run and the value)
    cells = build_cells(table.labels(), table.setups(stand_in), [0], tmp_path)
    assert len(cells) == len(table.labels()) * len(table.setups(stand_in))
    if stand_in:  # offline: small models built here, nothing from the Hub
        assert all(not c.config.get("pretrained", False) for c in cells), name


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


@pytest.mark.parametrize("method", ["pfedpg", "fedvpt", "fedvpt-deep"])
def test_pfedpg_cells_are_the_configs_users_run(method: str, tmp_path: Path) -> None:
    """pFedPG's Table 2 cells of the prompt methods set every key of the user's config file
    (configs/<method>/cifar100-<partition>-vit-b16.toml) to the same value."""
    files = {"pfedpg-cifar100-dir0.1": "cifar100-dir0.1-vit-b16"}
    files["pfedpg-cifar100-disjoint"] = "cifar100-disjoint-vit-b16"
    assert set(load_table("pfedpg-t2").setups()) == set(files)
    for setup, stem in files.items():
        users = tomllib.loads((CONFIG_ROOT / method / f"{stem}.toml").read_text())
        cell = cell_config(method, setup, 0, tmp_path)
        assert {k: cell.get(k) for k in users} == users, (method, setup)


def test_pfedseq_t1_rows_in_the_papers_order() -> None:
    table = load_table("pfedseq-t1")
    assert [r.name for r in table.rows][:2] == ["Local", "FedAvg"]
    assert table.rows[-1].name == "pFedSeq" and table.rows[-1].paper == (95.30, 94.30, 84.63, 45.25)
    assert len(table.rows) == 13 and table.reference == "local"


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
        (('missing = "not written"', 'method = "x"\nmissing = "y"'), "either 'method' or"),
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
