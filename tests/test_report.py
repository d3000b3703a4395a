"""The report: run directories -> tables with intervals and paired tests, figures, JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fedfm_flower.report import tables
from fedfm_flower.report.build import main as report_main
from fedfm_flower.report.figures import bytes_per_round, client_gains, curve_band
from fedfm_flower.report.runs import load_runs
from tests.report_runs import write_run_dir

# final per-client accuracy: method -> seed -> four clients (ids 0..3)
FINAL = {
    "local": {
        0: [0.60, 0.70, 0.80, 0.50],
        1: [0.62, 0.66, 0.79, 0.55],
        2: [0.58, 0.71, 0.83, 0.52],
    },
    "fedrep": {
        0: [0.66, 0.75, 0.84, 0.57],
        1: [0.67, 0.70, 0.85, 0.60],
        2: [0.63, 0.78, 0.86, 0.59],
    },
    "fedavg": {
        0: [0.61, 0.68, 0.81, 0.49],
        1: [0.60, 0.69, 0.78, 0.56],
        2: [0.59, 0.70, 0.82, 0.51],
    },
}


def write_run(root: Path, label: str, seed: int, finished: bool = True) -> Path:
    """A run of ``label`` on setup ``toy`` whose clients end at FINAL's values of its seed."""
    return write_run_dir(root, label, seed, FINAL[label][seed % 3], finished)


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for label in FINAL:
        for seed in (0, 1, 2):
            write_run(root, label, seed)
    write_run(root / "extra", "fedrep", 3, finished=False)  # unfinished: listed, never used
    return root


def test_cells_match_an_independent_computation(runs_dir: Path) -> None:
    runs, unfinished = load_runs([runs_dir])
    assert len(runs) == 9 and [p.name for p in unfinished] == ["fedrep-s3"]
    cells = tables.build_cells(runs, reference="local")
    for label, by_seed in FINAL.items():
        per_seed = [100 * np.mean(by_seed[s]) for s in (0, 1, 2)]
        low, high = stats.t.interval(0.95, 2, loc=np.mean(per_seed), scale=stats.sem(per_seed))
        cell = cells[("toy", label)]
        assert cell.mean == pytest.approx(np.mean(per_seed))
        assert cell.ci == pytest.approx((high - low) / 2)
        if label == "local":
            assert cell.versus is None and cell.mark == ""
            continue
        # the verdict: a paired t-test over the 3 seeds' client means (2 degrees of freedom)
        a = [100 * np.mean(by_seed[s]) for s in (0, 1, 2)]
        b = [100 * np.mean(FINAL["local"][s]) for s in (0, 1, 2)]
        test = cell.versus.test
        assert cell.versus.seeds == (0, 1, 2) and test.n == 3
        assert test.p_value == pytest.approx(stats.ttest_rel(a, b).pvalue)
        assert test.mean_difference == pytest.approx(np.mean(np.subtract(a, b)))
        half = stats.t.ppf(0.975, 2) * stats.sem(np.subtract(a, b))
        assert test.ci_half_width == pytest.approx(half)
        # beside it, not a verdict: the 12 (seed, client) units pooled (11 degrees of freedom)
        units_a = [100 * v for s in (0, 1, 2) for v in by_seed[s]]
        units_b = [100 * v for s in (0, 1, 2) for v in FINAL["local"][s]]
        pooled = cell.versus.pooled
        assert pooled.n == 12
        assert pooled.p_value == pytest.approx(stats.ttest_rel(units_a, units_b).pvalue)
        d = np.subtract(units_a, units_b)
        assert pooled.ci_half_width == pytest.approx(stats.t.ppf(0.975, 11) * stats.sem(d))
    assert cells[("toy", "fedrep")].mark == "↑"  # +5.5, +5.0, +5.5 over the seeds
    assert cells[("toy", "fedavg")].mark == ""  # mixed: no significant difference


def test_a_chosen_metric_replaces_the_primary_one_and_an_unknown_one_is_named(
    runs_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    runs, _ = load_runs([runs_dir], "error")
    local = next(r for r in runs if r.label == "local" and r.seed == 0)
    assert local.metric == "error"
    assert local.final == pytest.approx({c: 1.0 - v for c, v in enumerate(FINAL["local"][0])})
    assert report_main([str(runs_dir), "--out", str(tmp_path / "r"), "--metric", "error"]) == 0
    assert "test error" in (tmp_path / "r" / "report.md").read_text()
    assert report_main([str(runs_dir), "--out", str(tmp_path / "x"), "--metric", "rouge-9"]) == 2
    assert "'rouge-9'" in capsys.readouterr().err


def test_figures_data_pairs_clients_by_id(runs_dir: Path) -> None:
    runs, _ = load_runs([runs_dir])
    gains = client_gains(runs, "toy", "local")
    pairs = [zip(FINAL["fedrep"][s], FINAL["local"][s], strict=True) for s in (0, 1, 2)]
    expected = [100 * (x - y) for seed_pairs in pairs for x, y in seed_pairs]
    assert sorted(gains["fedrep"]) == pytest.approx(sorted(expected))
    rounds, means, widths = curve_band([r for r in runs if r.label == "fedrep"])
    assert rounds == [2, 3]
    final_means = [100 * np.mean(FINAL["fedrep"][s]) for s in (0, 1, 2)]
    assert means[1] == pytest.approx(np.mean(final_means))
    assert means[0] == pytest.approx(np.mean(final_means) - 10)
    assert bytes_per_round(runs, "toy")["local"] == pytest.approx((2000.0, 500.0))


def test_report_command_renders_every_output(runs_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "report"
    assert report_main([str(runs_dir), "--out", str(out), "--reference", "local"]) == 0
    for name in ("report.md", "table.md", "table.tex", "differences.md", "report.json"):
        assert (out / name).stat().st_size > 0
    for kind in ("curves", "gain", "bytes"):
        assert (out / f"{kind}-toy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "table.md").read_text()
    assert "| fedrep |" in table and "↑" in table and "local (reference)" in table
    assert r"\begin{tabular}" in (out / "table.tex").read_text()
    numbers = json.loads((out / "report.json").read_text())
    assert numbers["setups"]["toy"]["fedrep"]["versus-reference"]["verdict"] == "↑"
    assert numbers["unfinished"] and "fedrep-s3" in numbers["unfinished"][0]
    assert "fedrep-s3" in (out / "report.md").read_text()


def test_report_command_fails_clearly(runs_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "report"
    assert report_main([str(runs_dir), "--out", str(out), "--reference", "pfedpg"]) == 2
    assert "reference method 'pfedpg' has no finished run" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report_main([str(empty), "--out", str(out)]) == 2
    assert "no finished run" in capsys.readouterr().err
    assert report_main([str(tmp_path / "missing"), "--out", str(out)]) == 2


def test_a_setup_without_the_reference_gets_no_tests(runs_dir: Path, tmp_path: Path) -> None:
    other = runs_dir / "other"
    path = write_run(other, "fedrep", 0)
    config = json.loads((path / "config.json").read_text())
    config["run-config"]["setup"] = "partial"
    (path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "report"
    assert report_main([str(runs_dir), "--out", str(out)]) == 0
    assert "No finished run of **local** here" in (out / "report.md").read_text()
    assert not (out / "gain-partial.png").exists() and (out / "curves-partial.png").exists()
    numbers = json.loads((out / "report.json").read_text())
    assert numbers["setups"]["partial"]["fedrep"]["versus-reference"] is None


def test_against_pairs_each_method_with_its_own_other_runs(runs_dir: Path, tmp_path: Path) -> None:
    """``--against``: this set's fedrep against the other set's fedrep (written under the
    fedavg numbers), by seed and client id; a method the other set lacks is left out."""
    other = tmp_path / "other"
    for seed in (0, 1):
        path = write_run(other, "fedavg", seed)
        config = json.loads((path / "config.json").read_text())
        config["run-config"].update(method="fedrep", label="fedrep")
        (path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "report"
    argv = [str(runs_dir), "--out", str(out), "--against", str(other), "--against-name", "before"]
    assert report_main(argv) == 0
    (row,) = json.loads((out / "report.json").read_text())["against"]["rows"]
    assert row["method"] == "fedrep" and row["seeds"] == [0, 1]
    a = [100 * np.mean(FINAL["fedrep"][s]) for s in (0, 1)]  # over the 2 seeds
    b = [100 * np.mean(FINAL["fedavg"][s]) for s in (0, 1)]
    expected = stats.ttest_rel(a, b)
    assert row["test"] == "seeds" and row["pooled-units"]["n"] == 8
    assert row["mean-difference"] == pytest.approx(np.mean(np.subtract(a, b)))
    assert row["p-value"] == pytest.approx(expected.pvalue)
    per_seed = [100 * np.mean(FINAL["fedrep"][s]) for s in (0, 1)]
    assert row["mean"] == pytest.approx(np.mean(per_seed))
    assert row["verdict"] == ("higher" if expected.pvalue < 0.05 else "n.s.")
    assert "## Against before" in (out / "report.md").read_text()
    # nothing to compare with: exit 2 naming the path
    assert report_main([str(runs_dir), "--out", str(out), "--against", str(tmp_path / "no")]) == 2


def _relabel(path: Path, label: str) -> None:
    config = json.loads((path / "config.json").read_text())
    config["run-config"].update(method=label, label=label)
    (path / "config.json").write_text(json.dumps(config))


def _verdict(label_numbers: str) -> str:
    """The verdict against local over the 3 seeds' client means, by scipy."""
    a = [100 * np.mean(FINAL[label_numbers][s]) for s in (0, 1, 2)]
    b = [100 * np.mean(FINAL["local"][s]) for s in (0, 1, 2)]
    result = stats.ttest_rel(a, b)
    if result.pvalue >= 0.05:
        return "n.s."
    return "higher" if np.mean(np.subtract(a, b)) > 0 else "lower"


def test_an_earlier_tables_conclusions_are_checked_against_this_ones(
    runs_dir: Path, tmp_path: Path, capsys
) -> None:
    """``--conclusions-of``: each method's verdict against the reference in an earlier report
    (here its fedrep ran with fedavg's numbers, and it had a fedprox) against this table's."""
    earlier_runs = tmp_path / "earlier-runs"
    for seed in (0, 1, 2):
        write_run(earlier_runs, "local", seed)
        _relabel(write_run(earlier_runs / "a", "fedavg", seed), "fedrep")
        _relabel(write_run(earlier_runs / "b", "fedavg", seed), "fedprox")
    earlier = tmp_path / "earlier"
    assert report_main([str(earlier_runs), "--out", str(earlier)]) == 0
    out = tmp_path / "report"
    argv = [str(runs_dir), "--out", str(out), "--conclusions-of", str(earlier / "report.json")]
    assert report_main([*argv, "--conclusions-name", "4 trials"]) == 0
    rows = {
        r["method"]: r for r in json.loads((out / "report.json").read_text())["conclusions"]["rows"]
    }
    assert set(rows) == {"fedrep", "fedavg", "fedprox"}  # the reference is no conclusion
    assert rows["fedrep"]["here"]["verdict"] == _verdict("fedrep")
    assert rows["fedrep"]["earlier"]["verdict"] == _verdict("fedavg")
    assert rows["fedrep"]["holds"] == (_verdict("fedrep") == _verdict("fedavg"))
    a = [100 * np.mean(FINAL["fedavg"][s]) for s in (0, 1, 2)]
    b = [100 * np.mean(FINAL["local"][s]) for s in (0, 1, 2)]
    assert rows["fedrep"]["earlier"]["p-value"] == pytest.approx(stats.ttest_rel(a, b).pvalue)
    assert rows["fedrep"]["earlier"]["recomputed-over-seeds"] is False
    assert rows["fedavg"]["earlier"] is None and rows["fedavg"]["holds"] is None
    assert rows["fedprox"]["here"] is None and rows["fedprox"]["holds"] is None
    # each table's level of the method: its mean over seeds and the t interval
    for side, label in (("here", "fedrep"), ("earlier", "fedavg")):
        means = _seed_means(label)
        half = stats.t.ppf(0.975, 2) * np.std(means, ddof=1) / np.sqrt(3)
        level = rows["fedrep"][f"{side}-level"]
        assert level == pytest.approx({"mean": np.mean(means), "ci95": half})
    assert rows["fedprox"]["here-level"] is None and rows["fedavg"]["earlier-level"] is None
    text = (out / "report.md").read_text()
    section = text[text.index("## Conclusions of 4 trials") :]
    fedrep_line = next(line for line in section.splitlines() if line.startswith("| toy | fedrep |"))
    assert f"| {np.mean(_seed_means('fedrep')):.2f} ± " in fedrep_line
    assert "## Conclusions of 4 trials: do they hold here?" in text
    compared_holding = int(rows["fedrep"]["holds"])
    assert f"{compared_holding} of 1 conclusions hold" in text
    # another reference, or no report at all: exit 2 naming it
    capsys.readouterr()
    assert report_main([*argv, "--reference", "fedavg"]) == 2
    assert "earlier report's reference is 'local', not 'fedavg'" in capsys.readouterr().err
    assert report_main([*argv[:-1], str(tmp_path / "none.json")]) == 2
    assert "no earlier report at" in capsys.readouterr().err


def _seed_means(label: str) -> list[float]:
    return [100 * np.mean(FINAL[label][s]) for s in (0, 1, 2)]


def test_a_pair_of_methods_is_tested_over_seeds_here_and_in_the_earlier_table(
    runs_dir: Path, tmp_path: Path, capsys
) -> None:
    """``--pair A B``: A's paired difference to B over the seeds' means, by scipy, in this
    table and (``--conclusions-of``) in the earlier one, where its fedrep ran with fedavg's
    numbers and it had no fedavg; a pair naming a method without runs, or one method twice,
    exits 2 naming it."""
    earlier_runs = tmp_path / "earlier-runs"
    for seed in (0, 1, 2):
        write_run(earlier_runs, "local", seed)
        _relabel(write_run(earlier_runs / "a", "fedavg", seed), "fedrep")
    earlier = tmp_path / "earlier"
    assert report_main([str(earlier_runs), "--out", str(earlier)]) == 0
    out = tmp_path / "report"
    argv = [str(runs_dir), "--out", str(out), "--conclusions-of", str(earlier)]
    pairs = ["--pair", "fedrep", "local", "--pair", "fedrep", "fedavg"]
    assert report_main([*argv, "--conclusions-name", "4 trials", *pairs]) == 0
    between = json.loads((out / "report.json").read_text())["between"]
    assert between["name"] == "4 trials"
    rows = {(r["first"], r["second"]): r for r in between["rows"]}
    assert set(rows) == {("fedrep", "local"), ("fedrep", "fedavg")}
    for (first, second), row in rows.items():
        expected = stats.ttest_rel(_seed_means(first), _seed_means(second))
        a, b = _seed_means(first), _seed_means(second)
        assert row["here"]["mean-difference"] == pytest.approx(np.mean(np.subtract(a, b)))
        assert row["here"]["p-value"] == pytest.approx(expected.pvalue)
    earlier_test = stats.ttest_rel(_seed_means("fedavg"), _seed_means("local"))
    assert rows[("fedrep", "local")]["earlier"]["p-value"] == pytest.approx(earlier_test.pvalue)
    verdicts = [rows[("fedrep", "local")][side]["verdict"] for side in ("here", "earlier")]
    assert rows[("fedrep", "local")]["holds"] == (verdicts[0] == verdicts[1])
    assert rows[("fedrep", "fedavg")]["earlier"] is None  # no fedavg in the earlier table
    assert rows[("fedrep", "fedavg")]["holds"] is None
    text = (out / "report.md").read_text()
    assert "## Between methods" in text and "| toy | fedrep − local |" in text
    assert f"{int(rows[('fedrep', 'local')]['holds'])} of 1 conclusions between" in text
    # without an earlier table: this table's tests alone
    assert report_main([str(runs_dir), "--out", str(tmp_path / "alone"), *pairs[:3]]) == 0
    (alone,) = json.loads((tmp_path / "alone" / "report.json").read_text())["between"]["rows"]
    assert alone["earlier"] is None and alone["here"] == rows[("fedrep", "local")]["here"]
    capsys.readouterr()
    assert report_main([*argv, "--pair", "fedrep", "fedprox"]) == 2
    assert "no finished run of 'fedprox'" in capsys.readouterr().err
    assert report_main([*argv, "--pair", "local", "local"]) == 2
    assert "not compared with itself" in capsys.readouterr().err


def test_an_older_reports_pooled_verdict_is_recomputed_over_seeds(
    runs_dir: Path, tmp_path: Path
) -> None:
    """An earlier report.json written when verdicts pooled the (seed, client) units: its
    conclusion is the test over seeds of its per-seed means against the reference's, marked
    recomputed, not the pooled verdict it recorded."""
    earlier = tmp_path / "earlier"
    assert report_main([str(runs_dir), "--out", str(earlier)]) == 0
    document = json.loads((earlier / "report.json").read_text())
    for entry in document["setups"]["toy"].values():
        if entry["versus-reference"]:  # as the older reports recorded it
            pooled = entry["versus-reference"]["pooled-units"]
            entry["versus-reference"] = {**pooled, "units": pooled["n"], "verdict": "↓"}
    (earlier / "report.json").write_text(json.dumps(document))
    out = tmp_path / "report"
    argv = [str(runs_dir), "--out", str(out), "--conclusions-of", str(earlier)]
    assert report_main(argv) == 0
    rows = {
        r["method"]: r for r in json.loads((out / "report.json").read_text())["conclusions"]["rows"]
    }
    for label in ("fedrep", "fedavg"):
        earlier_row = rows[label]["earlier"]
        assert earlier_row["recomputed-over-seeds"] is True
        assert earlier_row["verdict"] == _verdict(label) == rows[label]["here"]["verdict"]
        assert earlier_row["p-value"] == pytest.approx(rows[label]["here"]["p-value"])
        assert rows[label]["holds"] is True
    assert "`*`: recomputed over seeds" in (out / "report.md").read_text()


def test_two_runs_of_one_seed_are_refused_naming_both(
    runs_dir: Path, tmp_path: Path, capsys
) -> None:
    write_run(runs_dir / "again", "local", 0)
    assert report_main([str(runs_dir), "--out", str(tmp_path / "r")]) == 2
    error = capsys.readouterr().err
    assert "two runs of local on toy at seed 0" in error and "again" in error


def test_a_run_with_a_final_value_not_finite_is_listed_not_reported(
    runs_dir: Path, tmp_path: Path
) -> None:
    path = write_run(runs_dir / "diverged", "fedavg", 0)
    _relabel(path, "fedprox")
    lines = (
        (path / "metrics.jsonl")
        .read_text()
        .replace('"test-accuracy": 0.61', '"test-accuracy": NaN')
    )
    (path / "metrics.jsonl").write_text(lines)
    runs, unfinished = load_runs([runs_dir])
    assert path.resolve() in unfinished and all(r.label != "fedprox" for r in runs)
    assert report_main([str(runs_dir), "--out", str(tmp_path / "r")]) == 0


def test_a_committed_reports_verdicts_are_rechecked_over_seeds(
    runs_dir: Path, tmp_path: Path
) -> None:
    """``report.recheck`` on a report.json that recorded pooled verdicts: each verdict over
    seeds is the scipy test of the per-seed means, and a recorded verdict it contradicts is
    listed as changed."""
    from fedfm_flower.report.recheck import main as recheck_main

    assert report_main([str(runs_dir), "--out", str(tmp_path / "r")]) == 0
    path = tmp_path / "r" / "report.json"
    document = json.loads(path.read_text())
    fedavg = document["setups"]["toy"]["fedavg"]["versus-reference"]
    document["setups"]["toy"]["fedavg"]["versus-reference"] = {**fedavg, "verdict": "↑"}
    del document["setups"]["toy"]["fedrep"]["versus-reference"]["test"]
    path.write_text(json.dumps(document))
    out = tmp_path / "verdicts.md"
    assert recheck_main([str(tmp_path / "r"), "--out", str(out)]) == 0
    text = out.read_text()
    assert "2 comparisons with 2 or more seeds; **1 change**" in text
    a = [100 * np.mean(FINAL["fedavg"][s]) for s in (0, 1, 2)]
    b = [100 * np.mean(FINAL["local"][s]) for s in (0, 1, 2)]
    p = stats.ttest_rel(a, b).pvalue
    assert p >= 0.05 and f"p = {p:.3g} | n.s. |" in text
    assert "| toy | fedavg | local | higher |" in text
    assert recheck_main([str(tmp_path / "none")]) == 2


def test_a_setup_only_the_earlier_table_has_is_listed_not_dropped(runs_dir: Path) -> None:
    from fedfm_flower.report.conclusions import build_conclusions

    runs, _ = load_runs([runs_dir])
    cells = tables.build_cells(runs, reference="local")
    versus = {"test": "seeds", "mean-difference": 1.0, "ci95": 0.5, "p-value": 0.01}
    earlier = {"setups": {"gone": {"fedrep": {"versus-reference": {**versus, "verdict": "↑"}}}}}
    rows = build_conclusions(cells, earlier, "local")
    (gone,) = [row for row in rows if row.setup == "gone"]
    assert gone.label == "fedrep" and gone.this is None and gone.earlier.verdict == "higher"
    assert gone.holds is None
