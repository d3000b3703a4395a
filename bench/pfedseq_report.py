"""Tables of a pFedSeq comparison grid run by ``bench.compare_methods``: accuracy with 95%
confidence intervals, paired tests against the baselines, and the calibration/update ratio.

    python -m bench.compare_methods --methods pfedseq fedrep ... --rounds 80 \\
        --set eval-every=5 --tag=-80r --out bench/results/pfedseq-80r
    python -m bench.pfedseq_report --out bench/results/pfedseq-80r --tag=-80r \\
        --methods pfedseq fedrep ... --rounds 20 80

Accuracy at round r is the mean over clients of each client's test accuracy with its
personalized model; the table shows the mean over seeds with a Student-t 95% interval over
seeds. Paired tests pair (seed, client): the same seed gives every method the same data,
partition and test split, so the per-client difference isolates the method. Rounds that are
not the run's last are read from the same run's ``metrics.jsonl`` (a 20-round figure from an
80-round run equals the 20-round run's: nothing before round 20 depends on the run length).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from safetensors import safe_open

from fedfm_flower.records.results import RunDirectory
from fedfm_flower.study.statistics import mean_ci, paired_test
from fedfm_flower.study.sweep import run_name

ROOT = Path(__file__).resolve().parent.parent
RATIO_ROUNDS = (11, 12, 13, 15, 20, 30, 40, 60, 80)


def client_accuracies(records: list[dict], server_round: int) -> list[float] | None:
    """Per-client test accuracy at ``server_round``, ordered by client id (None: no client was
    evaluated, because the round was not run or every client failed)."""
    for record in records:
        if record["round"] == server_round and record.get("evaluate"):
            evaluated = record["evaluate"].values()
            return [m["test-accuracy"] for m in sorted(evaluated, key=lambda m: m["client-id"])]
    return None


def personal_shape(run: RunDirectory) -> tuple[int, int] | None:
    """(N, D) of a pFedSeq run's personalized adapters, read from its last checkpoint."""
    rounds = run.checkpoint_rounds()
    if not rounds:
        return None
    path = run.checkpoint_dir / f"round_{rounds[-1]:05d}.safetensors"
    with safe_open(str(path), "pt") as handle:
        if "personal" not in handle.keys():  # noqa: SIM118 - safe_open has no __contains__
            return None
        n, d = handle.get_slice("personal").get_shape()
    return n, d


def alignments(records: list[dict], shape: tuple[int, int]) -> dict[int, float]:
    """cos(xi^{t-1}, Delta^t) over all clients per round, from the logged statistics.

    The eq. 5 surrogate is sum_i <xi_i^{t-1}, Delta_i^t>; dividing it by N D rms(xi^{t-1})
    rms(Delta^t) gives the cosine when every client reports (as in these grids). Positive:
    the clients' next training moves further along the calibration they were sent; negative:
    it undoes it.
    """
    n, d = shape
    out, previous = {}, None
    for record in records:
        server = record.get("server", {})
        surrogate = server.get("pfedseq-surrogate")
        update = server.get("pfedseq-update-rms")
        if previous and surrogate is not None and update and record["clients-reported"] == n:
            out[record["round"]] = surrogate / (n * d * previous * update)
        previous = server.get("pfedseq-calibration-rms")
    return out


def collect(out: Path, methods, setups, seeds, tag: str, rounds) -> dict:
    """{setup: {method: {'accuracy': {round: {seed: [per client]}}, 'ratio'/'alignment':
    {round: [per seed]}}}}."""
    data: dict = {}
    for setup in setups:
        for method in methods:
            entry: dict = {"accuracy": {r: {} for r in rounds}, "ratio": {}, "alignment": {}}
            for seed in seeds:
                path = out / "runs" / run_name(method, setup, tag, seed)
                if not (path / "summary.json").is_file():
                    continue
                run = RunDirectory(path)
                records = run.rounds()
                shape = personal_shape(run)
                if shape is not None:
                    for r, value in alignments(records, shape).items():
                        entry["alignment"].setdefault(r, []).append(value)
                for r in rounds:
                    accuracies = client_accuracies(records, r)
                    if accuracies is not None:
                        entry["accuracy"][r][seed] = accuracies
                for record in records:
                    ratio = record.get("server", {}).get("pfedseq-calibration-ratio")
                    if ratio is not None:
                        entry["ratio"].setdefault(record["round"], []).append(ratio)
            data.setdefault(setup, {})[method] = entry
    return data


def accuracy_table(data: dict, methods, setups, rounds) -> str:
    """Rows: methods; columns: setup x round; cells: mean +- 95% CI over seeds (n)."""
    head = [f"{s} r{r}" for s in setups for r in rounds]
    lines = ["| method | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for method in methods:
        cells = []
        for setup in setups:
            for r in rounds:
                per_seed = data[setup][method]["accuracy"][r]
                means = [100 * statistics.fmean(v) for v in per_seed.values()]
                if not means:
                    cells.append("—")
                    continue
                mean, half = mean_ci(means)
                cells.append(f"{mean:.2f} ± {half:.2f} (n={len(means)})")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_rows(data: dict, methods, baselines, setups, rounds) -> tuple[str, list[dict]]:
    """Paired (seed, client) differences method - baseline, in points, with p-values."""
    lines = [
        "| setup | round | method | vs | difference (points, 95% CI) | p | pairs | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows, seen = [], set()
    for setup in setups:
        for r in rounds:
            for method in methods:
                for base in baselines:
                    pair = frozenset((method, base))
                    if method == base or (setup, r, pair) in seen:
                        continue  # the same pair, the other way round, is already there
                    seen.add((setup, r, pair))
                    a_runs = data[setup][method]["accuracy"][r]
                    b_runs = data[setup][base]["accuracy"][r]
                    seeds = sorted(set(a_runs) & set(b_runs))
                    a = [100 * x for s in seeds for x in a_runs[s]]
                    b = [100 * x for s in seeds for x in b_runs[s]]
                    if len(a) < 2:
                        continue
                    test = paired_test(a, b)
                    verdict = "no difference shown"
                    if test.significant():
                        verdict = "better" if test.mean_difference > 0 else "worse"
                    rows.append(
                        {"setup": setup, "round": r, "method": method, "baseline": base}
                        | test.__dict__
                        | {"verdict": verdict}
                    )
                    lines.append(
                        f"| {setup} | {r} | {method} | {base} | "
                        f"{test.mean_difference:+.2f} ± {test.ci_half_width:.2f} | "
                        f"{test.p_value:.3f} | {test.n} | {verdict} |"
                    )
    return "\n".join(lines), rows


def per_round_table(data: dict, methods, setups, key: str) -> str:
    """A per-round statistic (``ratio`` or ``alignment``): mean over seeds (min-max)."""
    lines = [
        "| setup | method | " + " | ".join(f"r{r}" for r in RATIO_ROUNDS) + " |",
        "|---|---|" + "---|" * len(RATIO_ROUNDS),
    ]
    for setup in setups:
        for method in methods:
            ratios = data[setup][method][key]
            if not ratios:
                continue
            cells = []
            for r in RATIO_ROUNDS:
                values = ratios.get(r, [])
                cells.append(
                    f"{statistics.fmean(values):.3g} ({min(values):.2g}–{max(values):.2g})"
                    if values
                    else "—"
                )
            lines.append(f"| {setup} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the tables and write ``report<tag>.json`` / ``report<tag>.md`` under ``--out``."""
    parser = argparse.ArgumentParser(description="tables of a pFedSeq comparison grid")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pfedseq-80r")
    parser.add_argument("--tag", default="-80r")
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--baselines", nargs="+", default=["fedrep", "fedavg", "local"])
    parser.add_argument("--setups", nargs="+", default=["digits-label-skew", "digits-feature-skew"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", nargs="+", type=int, default=[20, 80])
    args = parser.parse_args(argv)
    data = collect(args.out, args.methods, args.setups, args.seeds, args.tag, args.rounds)
    accuracy = accuracy_table(data, args.methods, args.setups, args.rounds)
    paired, rows = paired_rows(data, args.methods, args.baselines, args.setups, args.rounds)
    ratios = per_round_table(data, args.methods, args.setups, "ratio")
    aligned = per_round_table(data, args.methods, args.setups, "alignment")
    markdown = "\n\n".join([accuracy, paired, ratios, aligned]) + "\n"
    (args.out / f"report{args.tag}.md").write_text(markdown)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "data": data, "paired": rows}
    (args.out / f"report{args.tag}.json").write_text(json.dumps(payload, indent=1))
    print(markdown)


if __name__ == "__main__":
    main()
