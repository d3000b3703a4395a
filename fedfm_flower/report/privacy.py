"""What differential privacy costs: the final metric against the epsilon spent, per method.

    python -m fedfm_flower.report.privacy RUNS... --out DIR

Reads finished runs (``fedfm_flower.report.runs``), groups them by (method label, noise
multiplier, DP mode) and reports, per group, the epsilon the runs spent (``dp-epsilon`` of
their summaries; equal over seeds, since it depends on sigma, delta and the rounds only) and
the final mean metric over clients with its mean and 95% Student-t interval over seeds. Runs
without DP are the groups at epsilon = inf, each method's reference level. Writes
``privacy.md`` (the table), ``privacy.json`` (every group with its seeds' values) and
``privacy.png`` (metric against epsilon, log scale, one line per method with its interval, the
no-DP level dashed).

The runs come from sweeps with ``--set dp=... dp-noise-multiplier=...`` and a ``--tag`` per
sigma into one sweep directory (docs/privacy.md has the commands).

Imports inside functions keep ``matplotlib`` out of this module's start-up.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedfm_flower.report.runs import RunResult, load_runs
from fedfm_flower.study.statistics import mean_ci


@dataclass(frozen=True)
class PrivacyPoint:
    """One (method, DP mode, sigma) group of runs: the epsilon spent and the metric over seeds."""

    label: str
    mode: str  # none, central, local
    noise_multiplier: float  # inf without DP
    epsilon: float  # inf without DP
    seeds: tuple[int, ...]
    values: tuple[float, ...]  # final mean metric of each seed's run, in seed order

    @property
    def mean_ci(self) -> tuple[float, float]:
        """Mean and 95% half-width over seeds."""
        return mean_ci(list(self.values))


def privacy_of(run: RunResult) -> tuple[str, float, float]:
    """(DP mode, sigma, epsilon spent) of a finished run, from its summary."""
    summary = json.loads((run.path / "summary.json").read_text())
    mode = summary.get("dp", "none")
    if mode == "none":
        return mode, math.inf, math.inf
    return mode, float(summary["dp-noise-multiplier"]), float(summary["dp-epsilon"])


def privacy_points(runs: Sequence[RunResult]) -> list[PrivacyPoint]:
    """The runs grouped by (label, mode, sigma), sorted by label then epsilon (no DP last);
    ValueError for runs of several setups, or two runs of one group and seed."""
    setups = sorted({run.setup for run in runs})
    if len(setups) > 1:
        raise ValueError(
            f"runs of {len(setups)} setups ({', '.join(setups)}): the privacy report is of one "
            "setup; report each setup's runs on their own"
        )
    groups: dict[tuple[str, str, float], list[tuple[int, float, float]]] = defaultdict(list)
    for run in runs:
        mode, sigma, epsilon = privacy_of(run)
        groups[(run.label, mode, sigma)].append((run.seed, epsilon, run.final_mean))
    points = []
    for (label, mode, sigma), members in groups.items():
        members.sort()
        seeds = [seed for seed, _, _ in members]
        if len(set(seeds)) < len(seeds):
            raise ValueError(f"{label} ({mode}, sigma {sigma}): two runs of one seed in {seeds}")
        epsilons = {round(e, 9) for _, e, _ in members}
        if len(epsilons) > 1:
            raise ValueError(
                f"{label} at sigma {sigma}: runs spent different epsilons {sorted(epsilons)}; "
                "were they run for different numbers of rounds or deltas?"
            )
        points.append(
            PrivacyPoint(
                label,
                mode,
                sigma,
                members[0][1],
                tuple(s for s, _, _ in members),
                tuple(v for _, _, v in members),
            )
        )
    return sorted(points, key=lambda p: (p.label, p.epsilon, p.mode))


def table(points: Sequence[PrivacyPoint], metric: str, scale: float = 100.0) -> str:
    """The markdown table: method, mode, sigma, epsilon, metric mean ± 95% CI, seeds."""
    lines = [
        f"| method | DP | sigma | epsilon | final {metric} (%) | seeds |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for point in points:
        mean, half = point.mean_ci
        sigma = "-" if math.isinf(point.noise_multiplier) else f"{point.noise_multiplier:g}"
        epsilon = "inf" if math.isinf(point.epsilon) else f"{point.epsilon:.3g}"
        lines.append(
            f"| {point.label} | {point.mode} | {sigma} | {epsilon} | "
            f"{scale * mean:.2f} ± {scale * half:.2f} | {len(point.values)} |"
        )
    return "\n".join(lines) + "\n"


def figure(points: Sequence[PrivacyPoint], metric: str, path: Path, scale: float = 100.0) -> Path:
    """Metric against epsilon (log scale) per method, with the no-DP level dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = sorted({p.label for p in points})
    for index, label in enumerate(labels):
        color = f"C{index}"
        private = [p for p in points if p.label == label and not math.isinf(p.epsilon)]
        if private:
            xs = [p.epsilon for p in private]
            means = [scale * p.mean_ci[0] for p in private]
            halves = [scale * p.mean_ci[1] for p in private]
            ax.errorbar(xs, means, yerr=halves, marker="o", capsize=3, color=color, label=label)
        for reference in (p for p in points if p.label == label and math.isinf(p.epsilon)):
            ax.axhline(scale * reference.mean_ci[0], color=color, linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("epsilon spent (log scale; dashed: without DP)")
    ax.set_ylabel(f"final mean {metric} (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Read the runs, write the table, the JSON and the figure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or folders of runs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    runs, _ = load_runs(args.runs)
    if not runs:
        parser.error(f"no finished run under {', '.join(map(str, args.runs))}")
    metrics = {r.metric for r in runs}
    if len(metrics) > 1:
        parser.error(f"the runs report different metrics {sorted(metrics)}; give one setup")
    metric = metrics.pop()
    try:
        points = privacy_points(runs)
    except ValueError as err:
        parser.error(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "privacy.md").write_text(table(points, metric))
    payload = [
        {
            "label": p.label,
            "dp": p.mode,
            "noise-multiplier": None if math.isinf(p.noise_multiplier) else p.noise_multiplier,
            "epsilon": None if math.isinf(p.epsilon) else p.epsilon,
            "seeds": list(p.seeds),
            "values": list(p.values),
        }
        for p in points
    ]
    (args.out / "privacy.json").write_text(
        json.dumps({"metric": metric, "points": payload}, indent=2)
    )
    figure(points, metric, args.out / "privacy.png")
    print(table(points, metric), end="")
    print(f"wrote {args.out / 'privacy.md'}, privacy.json and privacy.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
