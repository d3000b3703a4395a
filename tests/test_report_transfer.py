"""The report's transfer section (do a base setup's verdicts hold on its ``base~name`` setups?)
and the line saying which variance each setup's intervals carry."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedfm_flower.report import tables, transfer
from fedfm_flower.report.build import main as report_main
from fedfm_flower.report.runs import load_runs
from tests.report_runs import write_run_dir

SEEDS = (0, 1, 2)
# the reference's final per-client accuracy at each seed (ids 0..3)
LOCAL = {0: [0.60, 0.70, 0.80, 0.50], 1: [0.62, 0.66, 0.79, 0.55], 2: [0.58, 0.71, 0.83, 0.52]}
SPREAD = [0.01, -0.01, 0.02, -0.02]  # each client's own offset from the seed's shift
# a method's shift from the reference per seed (percentage points)
HIGHER, LOWER, LEVEL = (5.0, 5.5, 4.5), (-5.0, -5.5, -4.5), (3.0, -2.0, 0.5)
DESIGN = {
    "up": {"base": HIGHER, "base~a": HIGHER, "base~b": LOWER},
    "fade": {"base": HIGHER, "base~a": LEVEL, "base~b": HIGHER},
    "flat": {"base": LEVEL, "base~a": LEVEL, "base~b": LEVEL},
    "late": {"base": LEVEL, "base~a": LOWER},  # no runs on base~b
}
EXPECTED = {  # method -> outcome on base~a, base~b
    "up": ("holds", "reverses"),
    "fade": ("n.s.", "holds"),
    "flat": ("level", "level"),
    "late": ("new", "—"),
}


def finals(label: str, setup: str, seed: int) -> list[float]:
    """The clients' final values of ``label`` on ``setup`` at ``seed``."""
    if label == "local":
        return LOCAL[seed]
    shift = DESIGN[label][setup][seed] / 100
    return [v + shift + e for v, e in zip(LOCAL[seed], SPREAD, strict=True)]


def write_setup(
    root: Path, setup: str, labels: list[str], data_seed: int = 0, values: str = ""
) -> None:
    """Every seed of ``labels`` on ``setup`` with DESIGN's values of ``values`` (default:
    ``setup``'s); ``data_seed``: the run-config ``data-seed``."""
    for label in labels:
        for seed in SEEDS:
            final = finals(label, values or setup, seed)
            write_run_dir(root / setup, label, seed, final, setup=setup, config=_data(data_seed))


def _data(data_seed: int) -> dict[str, int]:
    return {"data-seed": data_seed}


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    """The base setup on one data draw; its transfer setups with a data draw per seed."""
    root = tmp_path / "runs"
    write_setup(root, "base", ["local", *DESIGN])
    for setup in ("base~a", "base~b"):
        labels = ["local", *(label for label in DESIGN if setup in DESIGN[label])]
        write_setup(root, setup, labels, data_seed=-1)
    return root


def scipy_difference(label: str, setup: str) -> tuple[float, float, float, str]:
    """(mean difference, 95% half-width, p, verdict) over the seeds' client means, by scipy."""
    a = [100 * np.mean(finals(label, setup, s)) for s in SEEDS]
    b = [100 * np.mean(LOCAL[s]) for s in SEEDS]
    d = np.subtract(a, b)
    p = stats.ttest_rel(a, b).pvalue
    verdict = "n.s." if p >= 0.05 else ("higher" if d.mean() > 0 else "lower")
    return d.mean(), stats.t.ppf(0.975, len(d) - 1) * stats.sem(d), p, verdict


def test_the_design_has_the_verdicts_it_claims() -> None:
    """The shifts give the verdicts the outcomes are named after (scipy)."""
    named = {HIGHER: "higher", LOWER: "lower", LEVEL: "n.s."}
    for label, by_setup in DESIGN.items():
        for setup, shift in by_setup.items():
            assert scipy_difference(label, setup)[3] == named[shift], (label, setup)


def test_each_outcome_follows_the_two_verdicts(runs_dir: Path) -> None:
    runs, _ = load_runs([runs_dir])
    rows = transfer.build_transfer(tables.build_cells(runs, "local"), "local")
    assert sorted(row.label for row in rows) == sorted(DESIGN)  # all but the reference
    for row in rows:
        assert row.base.setup == "base"
        assert [t.tested.setup for t in row.transfers] == ["base~a", "base~b"]
        assert tuple(t.outcome for t in row.transfers) == EXPECTED[row.label]
    late = next(row for row in rows if row.label == "late")
    assert late.transfers[0].text() == "new (lower)" and late.transfers[1].tested.difference is None
    assert transfer.holding(rows) == {"base": ["flat"]}


def test_the_differences_match_an_independent_computation(runs_dir: Path) -> None:
    runs, _ = load_runs([runs_dir])
    rows = transfer.build_transfer(tables.build_cells(runs, "local"), "local")
    for row in rows:
        for tested in (row.base, *(t.tested for t in row.transfers)):
            if tested.setup not in DESIGN[row.label]:
                continue
            mean, half, p, verdict = scipy_difference(row.label, tested.setup)
            difference = tested.difference
            assert difference.mean == pytest.approx(mean)
            assert difference.ci == pytest.approx(half)
            assert difference.p_value == pytest.approx(p)
            assert difference.verdict == verdict and tested.seeds == SEEDS


def test_the_report_renders_the_section_and_its_numbers(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert report_main([str(runs_dir), "--out", str(out), "--reference", "local"]) == 0
    text = (out / "report.md").read_text()
    section = text[text.index("## Transfer") :]
    assert text.index("## base~b") < text.index("## Transfer")  # after every setup's section
    assert "run unchanged on setups no trial saw" in section
    assert "each seed is a data draw and a training run" in section
    assert "### base" in section and "| method | base: Δ [95% CI], p | verdict |" in section
    up = next(line for line in section.splitlines() if line.startswith("| up |"))
    mean, half, p, _ = scipy_difference("up", "base~b")
    assert f"| {mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}], p = {p:.3g} | reverses |" in up
    assert "1 of 4 verdicts hold on every transfer setup: flat." in section
    numbers = json.loads((out / "report.json").read_text())["transfer"]
    assert numbers["reference"] == "local"
    base = numbers["bases"]["base"]
    assert base["transfers"] == ["base~a", "base~b"] and base["hold"] == ["flat"]
    for row in base["rows"]:
        assert [t["outcome"] for t in row["transfers"]] == list(EXPECTED[row["method"]])
        assert row["holds-on-every-transfer"] == (row["method"] == "flat")
        a = row["transfers"][0]
        assert a["setup"] == "base~a" and a["seeds"] == list(SEEDS)
        assert a["difference"]["mean-difference"] == pytest.approx(
            scipy_difference(row["method"], "base~a")[0]
        )
    late_b = next(r for r in base["rows"] if r["method"] == "late")["transfers"][1]
    assert late_b == {"setup": "base~b", "seeds": [], "difference": None, "outcome": "—"}


def test_a_report_without_transfer_setups_has_no_transfer_section(tmp_path: Path) -> None:
    """No ``~`` setup, or one whose base is not in the report: no section, no JSON key."""
    root = tmp_path / "runs"
    write_setup(root, "base", ["local", "up"])
    write_setup(root, "gone~a", ["local", "up"], values="base~a")
    out = tmp_path / "report"
    assert report_main([str(root), "--out", str(out)]) == 0
    assert "## Transfer" not in (out / "report.md").read_text()
    assert "transfer" not in json.loads((out / "report.json").read_text())


def test_each_setup_says_which_variance_its_intervals_carry(tmp_path: Path) -> None:
    """One data draw for every seed: training variance; ``data-seed`` -1 (the seed) or one
    per seed: data and training variance."""
    root = tmp_path / "runs"
    write_setup(root, "shared", ["local", "up"], data_seed=7, values="base")
    write_setup(root, "follows", ["local", "up"], data_seed=-1, values="base")
    for label in ("local", "up"):
        for seed in SEEDS:
            final = finals(label, "base", seed)
            config = _data(10 + seed)
            write_run_dir(root / "own", label, seed, final, setup="own", config=config)
    runs, _ = load_runs([root])
    assert {(r.setup, r.seed): r.data_seed for r in runs} == {
        **{("shared", s): 7 for s in SEEDS},
        **{("follows", s): s for s in SEEDS},
        **{("own", s): 10 + s for s in SEEDS},
    }
    out = tmp_path / "report"
    assert report_main([str(root), "--out", str(out)]) == 0
    lines = (out / "report.md").read_text().splitlines()
    assert "see each setup" in lines[2]

    def under(setup: str) -> str:
        return lines[lines.index(f"## {setup}") + 2]

    assert under("shared") == (
        "Intervals carry training variance only (one data draw: data-seed 7 for every seed)."
    )
    assert under("follows") == (
        "Intervals carry data and training variance (a data draw per seed: data-seeds 0, 1, 2 "
        "for seeds 0, 1, 2)."
    )
    assert "data-seeds 10, 11, 12 for seeds 0, 1, 2" in under("own")
    variance = json.loads((out / "report.json").read_text())["setup-variance"]
    assert variance["shared"] == {
        "variance": "training",
        "data-seeds": [7],
        "by-seed": {"0": [7], "1": [7], "2": [7]},
    }
    assert variance["follows"]["variance"] == variance["own"]["variance"] == "data-and-training"
    assert variance["own"]["data-seeds"] == [10, 11, 12]
