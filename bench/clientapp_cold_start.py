"""What one ClientApp message costs from a cold process, per method (deployment pays it each time).

    python -m bench.clientapp_cold_start [--methods fedrep pfedseq ...] [--repeats 3]

In deployment every message starts a fresh ``flwr-clientapp`` process, so the ClientApp's
imports, data preparation and model construction are paid per message. For each method this
starts a fresh interpreter per repeat that handles one real training message of round 1 (built
by the method's own strategy, delivered to the real ClientApp through the in-process Grid) and
reports, as the medians over repeats:

* ``interpreter``: from spawning the process to its first line (Python start-up);
* ``imports``: flwr, torch, timm, peft, the ClientApp and the method's client module;
* ``data``: the client's partition (loaders, partitioner, tensors);
* ``model``: backbone, tuner and head (the foundation model is read from the cache);
* ``train``: the training message itself (local epochs and the reply), everything warm;
* ``total``: wall time of the process minus the server-side set-up this script does in it
  (building the strategy and its message), i.e. what a ``flwr-clientapp`` process would cost.

The foundation model must be cached first (the script builds it once in the parent). Writes
``bench/results/clientapp_cold_start/{results.json,table.md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("interpreter", "imports", "data", "model", "train", "total")


def child(method: str, cache_dir: str, spawned: float) -> None:
    """Handle one training message in this (fresh) process and print the phase times as JSON."""
    first_line = time.time()
    started = time.perf_counter()
    import flwr  # noqa: F401
    import peft  # noqa: F401
    import timm  # noqa: F401
    import torch  # noqa: F401

    from client_apps.app import app  # noqa: F401
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.methods.halves import client_class

    config = ExperimentConfig.from_run_config(
        {**ExperimentConfig().to_run_config(), "method": method, "cache-dir": cache_dir}
    )
    client_class(method)
    imported = time.perf_counter()
    from fedfm_flower.data import load_client_data

    data = load_client_data(config, 0, 10)
    loaded = time.perf_counter()
    from fedfm_flower.methods.registry import trains_backbone, tuner_of
    from fedfm_flower.models import MODEL_CACHE, pick_device

    device = pick_device(config.device)
    whole = trains_backbone(config)
    MODEL_CACHE.get(config, tuner_of(config), data.num_classes, device, train_backbone=whole)
    built = time.perf_counter()
    from server_apps.inprocess import InProcessGrid, simulation_node_configs
    from server_apps.runner import build_strategy

    grid = InProcessGrid(app, config.to_run_config(), simulation_node_configs(10)[:1])
    strategy = build_strategy(config.replace(num_clients=10))
    strategy.learn_node_mapping(grid, 1)
    from flwr.app import ArrayRecord, ConfigRecord

    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    ready = time.perf_counter()
    replies = list(grid.send_and_receive(messages))
    trained = time.perf_counter()
    if len(replies) != 1 or replies[0].has_error():
        raise SystemExit(f"{method}: the training message failed")
    print(
        json.dumps(
            {
                "interpreter": first_line - spawned,
                "imports": imported - started,
                "data": loaded - imported,
                "model": built - loaded,
                "train": trained - ready,
                "server-side-setup": ready - built,
            }
        )
    )


def measure(method: str, cache_dir: str) -> dict[str, float]:
    """One cold process for ``method``: its phase times and total wall time."""
    spawned = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.clientapp_cold_start",
            "--child",
            method,
            cache_dir,
            str(spawned),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    total = time.time() - spawned
    if out.returncode != 0:
        raise RuntimeError(f"{method}: child failed:\n{out.stderr[-2000:]}")
    phases = json.loads(out.stdout.strip().splitlines()[-1])
    phases["total"] = total - phases["server-side-setup"]
    return phases


def runnable_methods(methods: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """``methods`` (None: every registered one) split into those the default run config can
    run and, for the others, why not."""
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.methods.registry import METHODS
    from fedfm_flower.methods.settings import ConfigError

    defaults = ExperimentConfig().to_run_config()
    usable: list[str] = []
    refused: dict[str, str] = {}
    for method in list(METHODS) if methods is None else methods:
        try:
            ExperimentConfig.from_run_config({**defaults, "method": method})
        except ConfigError as err:
            refused[method] = str(err)
        else:
            usable.append(method)
    return usable, refused


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """Markdown table of the median phase times (seconds) per method."""
    lines = [
        "| method | " + " | ".join(PHASES) + " |",
        "|---|" + "---:|" * len(PHASES),
    ]
    for method, runs in results.items():
        cells = [f"{statistics.median(r[p] for r in runs):.2f}" for p in PHASES]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Measure every method's cold-start message; print and write the table."""
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description="ClientApp cold-start cost per method")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="default: every registered method the default run config (tiny ViT) can run",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "fedfm-flower"))
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "clientapp_cold_start"
    )
    args = parser.parse_args(argv)
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.models.foundation import foundation_card

    usable, refused = runnable_methods(args.methods)
    if args.methods is not None and refused:
        parser.error("; ".join(refused.values()))
    args.methods = usable

    foundation_card(ExperimentConfig(cache_dir=args.cache_dir))  # build or find it once
    results: dict[str, list[dict[str, float]]] = {}
    for method in args.methods:
        results[method] = [measure(method, args.cache_dir) for _ in range(args.repeats)]
        print(
            f"{method}: {statistics.median(r['total'] for r in results[method]):.2f} s", flush=True
        )
    markdown = table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    payload = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit.stdout.strip(),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "repeats": args.repeats,
        "results": results,
    }
    (args.out / "results.json").write_text(json.dumps(payload, indent=2))
    (args.out / "table.md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
