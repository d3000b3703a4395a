"""Tables whose columns are client domains (pFedPG's Table 1, ``pfedpg-t1``): the declaration
and its checks, the domain a run records per client, and the report's cells computed here by
hand from synthetic run directories."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy import stats

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data.domains import DOMAINS
from fedfm_flower.report.build import main as report_main
from fedfm_flower.study.paper_tables import (
    averaged_domains,
    load_table,
    record_table,
    table_plan,
)
from fedfm_flower.study.sweep import cell_config
from fedfm_flower.tasks import task_of
from tests.report_runs import write_run_dir


def _declare(root: Path, text: str) -> None:
    (root / "tables").mkdir(parents=True, exist_ok=True)
    (root / "tables" / "t.toml").write_text(text)


def test_pfedpg_t1_columns_are_each_datasets_domains_and_their_average() -> None:
    """Office-Caltech10's 4 domains then its Avg., DomainNet's 6 then its Avg.; every printed
    Avg. is the mean of its row's domain figures (so the Average column is the paper's); the
    stand-in shows distinct glyph domains in each group."""
    table = load_table("pfedpg-t1")
    assert table.setups() == ["pfedpg-office-caltech10", "pfedpg-domainnet"]
    assert table.setups(stand_in=True) == ["glyphs-feature-skew"]
    office = ["amazon", "caltech", "dslr", "webcam"]
    domainnet = ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
    assert averaged_domains(table.columns, stand_in=False) == [
        *([d] for d in office),
        office,
        *([d] for d in domainnet),
        domainnet,
    ]
    stand_in = averaged_domains(table.columns, stand_in=True)
    assert stand_in[4] == ["print", "photo", "painting", "noisy-blur"]
    assert sorted(stand_in[11]) == sorted(
        ("print", "handwriting", "photo", "sketch", "painting", "noisy-blur")
    )
    assert [r.label for r in table.rows][-1] == "pfedpg" and len(table.rows) == 10
    for row in table.rows:
        figures = row.paper
        assert None not in figures, row.name
        assert np.mean(figures[0:4]) == pytest.approx(figures[4], abs=0.006), row.name
        assert np.mean(figures[5:11]) == pytest.approx(figures[11], abs=0.006), row.name
    assert table.labels() == load_table("pfedpg-t2").labels()  # Table 2's rows, same labels
    plan = table_plan(table, stand_in=True)
    assert "Office-Caltech10 A = glyphs-feature-skew print" in plan


def test_pfedpg_t1_cells_are_the_configs_users_run(tmp_path: Path) -> None:
    """pFedPG's, FedVPT's and FedVPT-D's cells set every key of the user's config file
    (configs/<method>/<dataset>-vit-b16.toml) to the same value, but the data-dir the setup
    names (where you put your copy of Office-Caltech10)."""
    import tomllib

    from fedfm_flower.config.files import CONFIG_ROOT

    for setup, stem in (
        ("pfedpg-office-caltech10", "office-caltech10-vit-b16"),
        ("pfedpg-domainnet", "domainnet-vit-b16"),
    ):
        for method in ("pfedpg", "fedvpt", "fedvpt-deep"):
            users = tomllib.loads((CONFIG_ROOT / method / f"{stem}.toml").read_text())
            cell = cell_config(method, setup, 0, tmp_path)
            assert {k: cell.get(k) for k in users} == users, (method, setup)


def test_pfedpg_t3_columns_are_the_four_sites_and_its_prompt_rows_run_k_3(tmp_path: Path) -> None:
    """Dermoscopic-FL's sites A-D then their Avg. (the mean of each row's printed four), one
    client per site; every prompt row tunes the paper's K = 3 there, the full-model rows none."""
    table = load_table("pfedpg-t3")
    assert table.setups() == ["pfedpg-dermoscopic-fl"]
    sites = ["A", "B", "C", "D"]
    assert averaged_domains(table.columns, stand_in=False) == [*([s] for s in sites), sites]
    assert averaged_domains(table.columns, stand_in=True)[4] == [
        "print",
        "photo",
        "painting",
        "noisy-blur",
    ]
    for row in table.rows:
        assert np.mean(row.paper[:4]) == pytest.approx(row.paper[4], abs=0.006), row.name
    prompts = {"local:vpt-k3", "fedvpt", "fedvpt-deep", "pfedpg"}
    for label in table.labels():
        cell = cell_config(label, "pfedpg-dermoscopic-fl", 0, tmp_path)
        assert (cell["dataset"], cell["partitioner"], cell["num-clients"]) == (
            "dermoscopic-fl",
            "natural-id",
            4,
        )
        assert cell.get("vpt-num-prompts") == (3 if label in prompts else None), label


MINIMAL = """paper = "P"
table = "Table 1"
title = "domains"
metric = "acc"
reference = "local"
[[columns]]
name = "A"
setup = "sa"
stand-in = "ga"
domain = "amazon"
stand-in-domain = "print"
[[columns]]
name = "W"
setup = "sa"
stand-in = "ga"
domain = "webcam"
[[columns]]
name = "Avg."
setup = "sa"
stand-in = "ga"
domain = "Average"
[[columns]]
name = "R"
setup = "sb"
stand-in = "ga"
domain = "real"
stand-in-domain = "photo"
[[columns]]
name = "Avg. 2"
setup = "sb"
stand-in = "ga"
domain = "Average"
[[rows]]
name = "Local"
method = "local"
paper = [80.0, 90.0, 85.0, 70.0, 70.0]
[[rows]]
name = "Fed"
method = "fedavg"
[[rows]]
name = "Other"
missing = "not written"
"""


FIRST = '[[columns]]\nname = "Z"\nsetup = "sa"\nstand-in = "ga"\ndomain = "Average"\n'


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('domain = "webcam"', ""), "columns W name no 'domain'"),
        (('domain = "amazon"\n', ""), "'stand-in-domain' needs the column's 'domain'"),
        (('domain = "webcam"', 'domain = "webcam"\ntask = "qa"'), "names a 'domain', a client"),
        (('stand-in-domain = "photo"', 'stand-in-domain = "Average"'), "stays one on the stand"),
        (('[[columns]]\nname = "A"', f'{FIRST}[[columns]]\nname = "A"'), "'Z': an 'Av.*none"),
        (('name = "W"\nsetup = "sa"', 'name = "W"\nsetup = "sc"'), "'Avg.': averages column 'W'"),
        (('domain = "webcam"', 'domain = "amazon"'), "averages domain amazon twice"),
        (('domain = "webcam"', 'domain = "webcam"\nstand-in-domain = "print"'), "print twice on"),
        (('method = "local"', 'method = "local"\nblock = "Personalization"'), "needs columns"),
    ],
)
def test_bad_domain_declarations_are_refused_naming_the_file(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    assert MINIMAL.count(change[0]) == 1, change
    _declare(tmp_path, MINIMAL.replace(*change))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "tables" / "t.toml"))) as err:
        load_table("t", tmp_path)
    assert re.search(message, str(err.value)), err.value


def test_a_run_records_each_clients_domain(tmp_path: Path) -> None:
    """What the runner stores as config.json's client-domains: an image folder's domain folder
    per natural-id client (sorted), digits-domains' synthetic domain, nothing for clients that
    mix domains."""
    rng = np.random.default_rng(0)
    for domain in ("webcam", "amazon", "dslr"):
        for i in range(6):
            folder = tmp_path / "oc" / domain / ("bike" if i % 2 else "mug")
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                folder / f"{i}.png"
            )
    config = ExperimentConfig().replace(
        dataset="office-caltech10",
        data_dir=str(tmp_path / "oc"),
        cache_dir=str(tmp_path / "cache"),
        partitioner="natural-id",
        image_size=8,
        public_fraction=0.1,
    )
    task = task_of(config)
    assert task.client_domains(config, 3) == {"0": "amazon", "1": "dslr", "2": "webcam"}
    digits = ExperimentConfig().replace(dataset="digits-domains", partitioner="iid")
    assert task.client_domains(digits, 4) == {str(p): DOMAINS[p].name for p in range(4)}
    assert task.client_domains(config.replace(partitioner="iid"), 3) == {}
    assert task.client_domains(ExperimentConfig(), 10) == {}  # digits: no domains


# final per-client accuracy: method -> seed -> one value per client id. Setup sa: partitions
# 0, 1, 2 are amazon, webcam, webcam, and seed 1's nodes report client ids whose partitions
# are shuffled (summary.json's client-partitions); setup sb: partition 0 is real.
FINAL = {
    "local": {0: (0.80, 0.90, 0.70), 1: (0.84, 0.60, 0.96)},
    "fedavg": {0: (0.70, 0.75, 0.85), 1: (0.72, 0.90, 0.80)},
}
DOMAINS_OF = {"sa": {"0": "amazon", "1": "webcam", "2": "webcam"}, "sb": {"0": "real"}}
SHUFFLED = {"0": 2, "1": 0, "2": 1}  # seed 1 on sa: client id -> its partition


def _write_domain_run(root: Path, label: str, seed: int, setup: str) -> None:
    final = FINAL[label][seed] if setup == "sa" else FINAL[label][seed][:1]
    path = write_run_dir(root / setup, label, seed, final, setup=setup)
    payload = json.loads((path / "config.json").read_text())
    payload["client-domains"] = DOMAINS_OF[setup]
    (path / "config.json").write_text(json.dumps(payload))
    if setup == "sa" and seed == 1:
        summary = {"primary-metric": "accuracy", "client-partitions": SHUFFLED}
        (path / "summary.json").write_text(json.dumps(summary))


def _by_hand(per_seed: list[float]) -> tuple[float, float]:
    """Mean and 95% half-width over seeds (scipy's t interval), in percent."""
    scaled = [100 * v for v in per_seed]
    low, high = stats.t.interval(
        0.95, len(scaled) - 1, loc=np.mean(scaled), scale=stats.sem(scaled)
    )
    return float(np.mean(scaled)), (high - low) / 2


def _expected(label: str) -> list[tuple[float, float]]:
    """The row's cells: A (amazon), W (webcam), Avg. of the two, R (real), Avg. 2 of R."""
    amazon, webcam, real = [], [], []
    for seed in (0, 1):
        partition_of = {int(c): p for c, p in SHUFFLED.items()} if seed == 1 else {}
        by_domain: dict[str, list[float]] = {}
        for client, value in enumerate(FINAL[label][seed]):
            domain = DOMAINS_OF["sa"][str(partition_of.get(client, client))]
            by_domain.setdefault(domain, []).append(value)
        amazon.append(np.mean(by_domain["amazon"]))
        webcam.append(np.mean(by_domain["webcam"]))
        real.append(FINAL[label][seed][0])
    average = [(a + w) / 2 for a, w in zip(amazon, webcam, strict=True)]
    return [_by_hand(v) for v in (amazon, webcam, average, real, real)]


def test_report_lays_a_domain_column_table_out_as_the_paper(tmp_path: Path) -> None:
    """Each cell is the mean over seeds of the domain's clients' final accuracy (an Average:
    of each seed's mean over the group's domains), computed here by hand, with the client
    ids mapped to partitions as the runs recorded; a domain no client has is named."""
    _declare(tmp_path / "configs", MINIMAL)
    table = load_table("t", tmp_path / "configs")
    runs = tmp_path / "runs"
    for label in FINAL:
        for seed in (0, 1):
            for setup in ("sa", "sb"):
                _write_domain_run(runs, label, seed, setup)
    record_table(runs, table, stand_in=False)
    out = tmp_path / "report"
    assert report_main([str(runs), "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    section = text[text.index("## P, Table 1: domains") :].split("\n## ")[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    assert lines[0] == (
        "| row | method | A (`amazon`) | paper | W (`webcam`) | paper | Avg. | paper "
        "| R (`real`) | paper | Avg. 2 | paper |"
    )

    def shown(label: str, paper: list[str]) -> str:
        cells = [f"{m:.2f} ± {h:.2f}" for m, h in _expected(label)]
        return " | ".join(f"{c} | {p}" for c, p in zip(cells, paper, strict=True))

    figures = ["80.00", "90.00", "85.00", "70.00", "70.00"]
    assert lines[1] == f"| Local | `local` | {shown('local', figures)} |"
    assert lines[2] == f"| Fed | `fedavg` | {shown('fedavg', ['—'] * 5)} |"
    assert lines[3] == "| Other | not here |" + " — | — |" * 5
    assert "Columns without a client" not in section
    numbers = json.loads((out / "report.json").read_text())["paper-table"]
    average = numbers["rows"][1]["cells"]["Avg."]
    mean, half = _expected("fedavg")[2]
    assert average["domains"] == ["amazon", "webcam"] and average["seeds"] == [0, 1]
    assert (average["mean"], average["ci95"]) == (pytest.approx(mean), pytest.approx(half))

    # the same runs read as the stand-in's, on setup ga, where no run is: dashes; and runs
    # on ga whose A column's domain (print) no client has: named with the domains found
    stand_in_runs = tmp_path / "stand-in-runs"
    for label in FINAL:
        for seed in (0, 1):
            _write_domain_run(stand_in_runs, label, seed, "sa")
    for path in stand_in_runs.rglob("config.json"):
        payload = json.loads(path.read_text())
        payload["run-config"]["setup"] = "ga"
        path.write_text(json.dumps(payload))
    record_table(stand_in_runs, table, stand_in=True)
    assert report_main([str(stand_in_runs), "--out", str(out)]) == 0
    section = (out / "report.md").read_text().split("## P, Table 1: domains")[1].split("\n## ")[0]
    assert "| row | method | A (`print`) | W (`webcam`) | Avg. | R (`photo`) | Avg. 2 |" in section
    (webcam, webcam_half) = _expected("local")[1]
    assert f"| Local | `local` | — | {webcam:.2f} ± {webcam_half:.2f} | — | — | — |" in section
    assert (
        "- A: domain `print` is no client's domain in the runs on `ga` (their domains: "
        "`amazon`, `webcam`)" in section
    )
