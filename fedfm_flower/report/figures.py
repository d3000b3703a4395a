"""The report's figures (PNG, matplotlib's Agg backend): learning curves, client-wise gain
over the reference as a density (FedPerfix's Fig. 3), and bytes per round.

Imports inside functions keep ``matplotlib`` out of this module's start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy.stats import gaussian_kde

from fedfm_flower.report.runs import RunResult
from fedfm_flower.report.tables import paired_units
from fedfm_flower.study.statistics import mean_ci


def _pyplot():  # noqa: ANN202 - matplotlib.pyplot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _by_label(runs: Sequence[RunResult], setup: str) -> dict[str, list[RunResult]]:
    grouped: dict[str, list[RunResult]] = {}
    for run in runs:
        if run.setup == setup:
            grouped.setdefault(run.label, []).append(run)
    return grouped


def curve_band(runs: Sequence[RunResult], scale: float = 100.0) -> tuple[list[int], list, list]:
    """(rounds, mean, 95% half-width) over seeds at the rounds every run evaluated."""
    rounds = sorted(set.intersection(*(set(r.rounds) for r in runs))) if runs else []
    means, widths = [], []
    for server_round in rounds:
        values = [scale * r.curve[r.rounds.index(server_round)] for r in runs]
        mean, width = mean_ci(values)
        means.append(mean)
        widths.append(width)
    return rounds, means, widths


def learning_curves(runs: Sequence[RunResult], setup: str, path: Path) -> Path:
    """Mean metric over clients per evaluated round, mean and 95% band over seeds, per method."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    metric = "metric"
    for label, group in _by_label(runs, setup).items():
        metric = group[0].metric
        rounds, means, widths = curve_band(group)
        if not rounds:
            continue
        means_a, widths_a = np.asarray(means), np.asarray(widths)
        (line,) = axes.plot(rounds, means_a, marker="o", markersize=3, label=label)
        axes.fill_between(
            rounds, means_a - widths_a, means_a + widths_a, color=line.get_color(), alpha=0.15
        )
    axes.set_xlabel("round")
    axes.set_ylabel(f"mean client test {metric} (%)")
    axes.set_title(f"{setup}: learning curves (band: 95% CI over seeds)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def client_gains(
    runs: Sequence[RunResult], setup: str, reference: str, scale: float = 100.0
) -> dict[str, np.ndarray]:
    """{method: final metric minus the reference's, per (seed, client)} for one setup."""
    grouped = _by_label(runs, setup)
    base = {r.seed: r for r in grouped.get(reference, [])}
    gains = {}
    for label, group in grouped.items():
        if label == reference:
            continue
        values: list[float] = []
        for run in group:
            if run.seed in base:
                a, b = paired_units(run, base[run.seed])
                values += [scale * (x - y) for x, y in zip(a, b, strict=True)]
        if values:
            gains[label] = np.asarray(values)
    return gains


def gain_density(runs: Sequence[RunResult], setup: str, reference: str, path: Path) -> Path:
    """Density over (seed, client) of each method's gain over ``reference`` (Gaussian KDE;
    a rug of the values where they are too few or all equal)."""

    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    gains = client_gains(runs, setup, reference)
    if gains:
        low = min(v.min() for v in gains.values())
        high = max(v.max() for v in gains.values())
        pad = max(1.0, 0.1 * (high - low))
        grid = np.linspace(low - pad, high + pad, 400)
        for label, values in gains.items():
            if len(values) > 2 and np.ptp(values) > 0:
                axes.plot(grid, gaussian_kde(values)(grid), label=f"{label} (n={len(values)})")
            else:
                axes.plot(values, np.zeros_like(values), "|", markersize=15, label=label)
    axes.axvline(0.0, color="black", linewidth=0.8)
    axes.set_xlabel(f"client-wise gain over {reference} (points)")
    axes.set_ylabel("density")
    axes.set_title(f"{setup}: gain over {reference} per (seed, client)")
    axes.grid(alpha=0.3)
    if gains:  # no method beside the reference: no curve, no legend
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def bytes_per_round(runs: Sequence[RunResult], setup: str) -> dict[str, tuple[float, float]]:
    """{method: (mean bytes down, mean bytes up) per client per round} for one setup."""
    out = {}
    for label, group in _by_label(runs, setup).items():
        down, up = [], []
        for run in group:
            for d, u, n in zip(run.bytes_down, run.bytes_up, run.clients_reported, strict=True):
                if n:
                    down.append(d / n)
                    up.append(u / n)
        out[label] = (float(np.mean(down)) if down else 0.0, float(np.mean(up)) if up else 0.0)
    return out


def bytes_chart(runs: Sequence[RunResult], setup: str, path: Path) -> Path:
    """Bars: bytes down and up per reporting client per round, per method (log scale)."""
    plt = _pyplot()
    traffic = bytes_per_round(runs, setup)
    labels = list(traffic)
    positions = np.arange(len(labels))
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    down = [max(traffic[label][0], 1.0) for label in labels]
    up = [max(traffic[label][1], 1.0) for label in labels]
    axes.bar(positions - 0.2, down, width=0.4, label="down")
    axes.bar(positions + 0.2, up, width=0.4, label="up")
    axes.set_xticks(positions, labels, rotation=45, ha="right", fontsize=7)
    axes.set_yscale("log")
    axes.set_ylabel("bytes per client per round")
    axes.set_title(f"{setup}: communication")
    axes.grid(alpha=0.3, axis="y")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
