"""TAP's Table 7: per-client parameters, memory and post-FL distillation time, TAP vs no TAP.

    python -m bench.tap_footprint --quick       # 3 clients (one per group), CPU, about a minute
    python -m bench.tap_footprint               # the multi-task setup's settings (30 clients)
    python -m bench.tap_footprint --device cuda --per-group 2 --set batch-size=64

Both settings run on the same multi-task federation (``dataset = multitask``, backbone
``mm-offline``) with the same run config, in the same invocation:

* ``No TAP``: component-wise FedAvg (``method = fedavg``): a client trains and sends the
  components its modality-task pairs use;
* ``TAP``: the TAP client (``method = tap``): W~ and its personal copy X of the same
  components, then the post-FL distillation (stage 2).

Per client, in a fresh process per (setting, client) (forked from a forkserver that has only
imported the libraries and the client code, ``PRELOAD``), the real client code runs as the
ClientApp runs it (``ClientRuntime.from_context`` on a Flower ``Context``, the method's
``ClientLogic`` from the registry): ``--rounds`` stage-1 rounds (``train``, each round starting
from what the client sent in the previous one: the server's average of one client), then, for
TAP, the post-FL round (``TAPClient.post_train``: W~ trained P = ``tap-distill-steps``
iterations, then X distilled P iterations on eq. 6). Columns, averaged over clients:

* **total params**: the parameters the client holds (``fedfm_flower.models.footprint``): its
  components' trainable parameters and the frozen ones they sit on; TAP holds the trainable
  ones twice (W~ and X), the frozen ones once;
* **% trainable**: trainable (every copy) over total;
* **memory (params)**: the bytes of those tensors (the paper's "Avg. Memory" is its parameter
  count times 4 bytes, to the digit);
* **peak RSS**: the worker's peak resident memory (``resource.getrusage``'s ``ru_maxrss``)
  at the end of stage 1 and of stage 2, minus its peak before the client starts (the imports:
  torch, transformers, Flower, the client code), so it is the client's own: model and data
  (with what building them needed at its peak), optimizer state, activations, personal state.
  On CUDA the table shows ``torch.cuda.max_memory_allocated`` per stage instead. The JSON
  also has, from ``bench.process_memory.PeakMemory``, the sampled peak PSS of the forkserver
  and the worker together, and on a GPU the device memory in use above idle (NVML, CUDA
  context included);
* **KD time**: wall-clock seconds of ``TAPClient.post_train`` (both halves of stage 2, and
  the save of X), per client.

Run config: ``configs/setups/<--setup>.toml`` with ``configs/tap/<setup>.toml`` layered as the
sweep does; by default the first multi-task setup under ``configs/setups`` when there is one,
else ``DEFAULT_CONFIG`` (the docs' TAP command: 30 clients, 32 px images, LoRA rank 4, AdamW,
batch 32, 20 local steps; P = 50, the paper's). ``--quick`` overlays ``QUICK``: 3 clients, batch
8, 2 local steps, P = 5, foundations pretrained 2 epochs. ``--set KEY=VALUE`` overlays any key.
``--per-group K`` measures the first K clients of each group of pairs (a group's clients hold
the same components) and weighs each group by its size. Writes ``results-<mode>-<device>.json``
and ``table-<mode>-<device>.md`` under ``--out`` (default ``bench/results/tap_footprint``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import tomllib
import traceback
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "tap_footprint"
SETUPS = ROOT / "configs" / "setups"
NO_TAP, TAP = "No TAP", "TAP"
SETTINGS: dict[str, str] = {NO_TAP: "fedavg", TAP: "tap"}
TAG = f"tap-footprint-{os.getpid()}"  # FEDFM_BENCH_ID of the worker processes
# What the client code imports, loaded once by the forkserver: a worker's memory above them is
# the client's own.
PRELOAD: tuple[str, ...] = (
    "torch",
    "transformers.models.llama.modeling_llama",
    "flwr.app",
    "client_apps.base",
    "client_apps.split",
    "client_apps.tap",
    "fedfm_flower.tasks.distillation",
    "fedfm_flower.models.footprint",
    "fedfm_flower.models.multimodal",
    "fedfm_flower.methods.registry",
    "fedfm_flower.tasks.multitask",
    "fedfm_flower.tasks.training",
)
MIB = 1024 * 1024
# Without a multi-task setup under configs/setups: the TAP command of docs/methods/tap.md.
DEFAULT_CONFIG: dict[str, Any] = {
    "dataset": "multitask",
    "backbone": "mm-offline",
    "num-clients": 30,
    "image-size": 32,
    "lora-rank": 4,
    "optimizer": "adamw",
    "lr": 0.0003,
    "batch-size": 32,
    "local-steps": 20,
}
QUICK: dict[str, Any] = {
    "num-clients": 3,
    "batch-size": 8,
    "local-steps": 2,
    "tap-distill-steps": 5,
    "pretrain-epochs": 2,
}


# ---------------------------------------------------------------------------------------------
# The run config


def multitask_setups(setups: Path = SETUPS) -> list[str]:
    """Names of the setups under ``setups`` whose dataset is ``multitask``, sorted."""
    found = []
    for path in sorted(setups.glob("*.toml")):
        if tomllib.loads(path.read_text()).get("dataset") == "multitask":
            found.append(path.stem)
    return found


def base_run_config(setup: str, overrides: dict[str, Any], quick: bool, state_dir: str) -> dict:
    """The full run config of TAP's side (the setup's, or ``DEFAULT_CONFIG``, then ``QUICK``,
    then the overrides); the no-TAP side differs only in ``method``."""
    from fedfm_flower.config.experiment import ExperimentConfig

    if setup:
        from fedfm_flower.study.sweep import cell_config

        layered = cell_config("tap", setup, 0, Path(state_dir))
    else:
        layered = dict(DEFAULT_CONFIG)
    run_config = {
        **ExperimentConfig().to_run_config(),
        **layered,
        **(QUICK if quick else {}),
        **overrides,
        "method": "tap",
        "run-name": "tap-footprint",
        "client-state-dir": state_dir,
    }
    ExperimentConfig.from_run_config(run_config)  # a bad key fails here, before any worker
    return run_config


# ---------------------------------------------------------------------------------------------
# One (setting, client), in a fresh process


def max_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux: ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one client of one setting (the module docstring); runs in its own process."""
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    for module in PRELOAD:  # no-ops when the forkserver preloaded them
        importlib.import_module(module)
    from flwr.app import Context, RecordDict

    from client_apps.base import ClientRuntime
    from fedfm_flower.methods.halves import client_class
    from fedfm_flower.models.footprint import client_footprint

    baseline = max_rss_bytes()
    run_config, client = spec["run-config"], spec["client"]
    cuda = run_config["device"] == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def cuda_peak() -> int | None:
        return int(torch.cuda.max_memory_allocated()) if cuda else None

    node = {"partition-id": client, "num-partitions": run_config["num-clients"]}
    context = Context(
        run_id=1, node_id=1000 + client, node_config=node, state=RecordDict(), run_config=run_config
    )
    started = time.perf_counter()
    runtime = ClientRuntime.from_context(context, run_config["run-name"])
    logic = client_class(runtime.method.spec)()
    model = runtime.model()
    holds = runtime.task.holdings(runtime.data)
    received = model.tensors_named(model.names_for(holds))  # the server's initial components
    footprint = client_footprint(model, holds)
    out: dict[str, Any] = {
        "client": client,
        "holds": list(holds),
        "trainable": footprint.trainable,
        "frozen": footprint.frozen,
        "trainable-bytes": footprint.trainable_bytes,
        "frozen-bytes": footprint.frozen_bytes,
        "setup-seconds": time.perf_counter() - started,
        "baseline-rss": baseline,
        "setup-rss": max_rss_bytes() - baseline,
    }
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rounds = []
    for server_round in range(1, spec["rounds"] + 1):
        sync()
        started = time.perf_counter()
        received, stats = logic.train(runtime, received, server_round)
        sync()
        rounds.append({"seconds": time.perf_counter() - started, "steps": stats.num_steps})
    out |= {"rounds": rounds, "stage1-rss": max_rss_bytes() - baseline, "stage1-cuda": cuda_peak()}
    if spec["post-train"]:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        started = time.perf_counter()
        _, stats = logic.post_train(runtime, received, spec["rounds"] + 1)
        sync()
        out |= {
            "kd-seconds": time.perf_counter() - started,
            "kd-steps": stats.num_steps,
            "stage2-rss": max_rss_bytes() - baseline,
            "stage2-cuda": cuda_peak(),
        }
    return out


def _child(spec: dict[str, Any], conn: Connection) -> None:
    """A worker process's body: ``worker(spec)`` or its traceback, sent back on ``conn``."""
    try:
        conn.send(("ok", worker(spec)))
    except BaseException:  # noqa: BLE001 - reported by the parent, which raises
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def worker_context() -> BaseContext:
    """A forkserver context whose server has imported ``PRELOAD`` (once): each worker is a fresh
    process forked from it, its memory starting from the imports'. The server and its children
    carry ``FEDFM_BENCH_ID``, for ``bench.process_memory.PeakMemory``."""
    from bench.process_memory import TAG_VAR

    os.environ[TAG_VAR] = TAG
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def run_worker(spec: dict[str, Any], context: BaseContext) -> dict[str, Any]:
    """``worker(spec)`` in a fresh process of ``context``, with the peak PSS (and GPU memory)
    of the tagged processes sampled by ``bench.process_memory.PeakMemory``."""
    from bench.process_memory import PeakMemory

    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(spec, send))
    with PeakMemory(TAG) as peak:
        process.start()
        send.close()
        try:
            status, payload = receive.recv()
        except EOFError:
            status, payload = "error", "the worker died without a result"
        process.join()
    if status != "ok":
        raise RuntimeError(
            f"worker for client {spec['client']} ({spec['run-config']['method']}) failed "
            f"(exit {process.exitcode}):\n{payload}"
        )
    return payload | {"sampled-peak-pss": peak.peak_bytes, "sampled-peak-gpu": peak.peak_gpu_bytes}


# ---------------------------------------------------------------------------------------------
# The measurement


def chosen_clients(holdings: dict[str, tuple[str, ...]], per_group: int) -> dict[int, float]:
    """{client: weight}: the first ``per_group`` clients of every group of equal holdings (0:
    all), each weighted so that its group counts by its size."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for client, held in sorted(holdings.items(), key=lambda kv: int(kv[0])):
        groups.setdefault(tuple(held), []).append(int(client))
    chosen: dict[int, float] = {}
    for members in groups.values():
        picked = members[:per_group] if per_group else members
        for client in picked:
            chosen[client] = len(members) / len(picked)
    return chosen


def weighted_mean(rows: list[dict[str, Any]], key: str, weights: dict[int, float]) -> float:
    """Mean of ``row[key]`` over the rows, each weighted by its client's weight."""
    total = sum(weights[r["client"]] for r in rows)
    return sum(r[key] * weights[r["client"]] for r in rows) / total


def summarize(rows: list[dict[str, Any]], copies: int, weights: dict[int, float]) -> dict:
    """One setting's averages over its clients' rows (``copies``: extra trainable copies)."""
    for row in rows:
        row["total"] = row["frozen"] + (1 + copies) * row["trainable"]
        row["held-bytes"] = row["frozen-bytes"] + (1 + copies) * row["trainable-bytes"]
        row["trainable-fraction"] = (1 + copies) * row["trainable"] / row["total"]
        row["round-seconds"] = statistics.fmean(r["seconds"] for r in row["rounds"])
    keys = ["total", "trainable-fraction", "held-bytes", "setup-rss", "stage1-rss"]
    keys += ["round-seconds"]
    if "kd-seconds" in rows[0]:
        keys += ["stage2-rss", "kd-seconds"]
    if rows[0].get("stage1-cuda") is not None:
        keys += ["stage1-cuda"] + (["stage2-cuda"] if "kd-seconds" in rows[0] else [])
    summary = {k: weighted_mean(rows, k, weights) for k in keys}
    summary["clients"] = rows
    return summary


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every chosen client under both settings; the results as a JSON-able dict."""
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.config.overrides import parse_overrides
    from fedfm_flower.tasks import task_of

    setup = args.setup
    if setup is None:
        found = multitask_setups()
        setup = found[0] if found else ""
    overrides = {**parse_overrides(args.set), "device": args.device, "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="tap-footprint-") as state_dir:
        run_config = base_run_config(setup, overrides, args.quick, state_dir)
        config = ExperimentConfig.from_run_config(run_config)
        holdings = task_of(config).client_holdings(config, config.num_clients)
        weights = chosen_clients(holdings, args.per_group)
        context = worker_context()
        settings: dict[str, Any] = {}
        for label, method in SETTINGS.items():
            rows = []
            for client in weights:
                spec = {
                    "run-config": {**run_config, "method": method},
                    "client": client,
                    "rounds": args.rounds,
                    "post-train": method == "tap",
                    "threads": args.threads,
                }
                row = run_worker(spec, context)
                rows.append(row)
                kd = f", KD {row['kd-seconds']:.2f} s" if "kd-seconds" in row else ""
                print(
                    f"{label} client {client} ({'+'.join(row['holds'])}): "
                    f"{row['frozen'] + row['trainable']:,} params held once, "
                    f"peak RSS +{row['stage1-rss'] / MIB:.1f} MiB{kd}",
                    flush=True,
                )
            settings[label] = summarize(rows, 1 if method == "tap" else 0, weights)
    return {
        "settings": {
            "mode": "quick" if args.quick else "default",
            "setup": setup or "DEFAULT_CONFIG (bench/tap_footprint.py)",
            "device": args.device,
            "num-clients": config.num_clients,
            "clients-measured": sorted(weights),
            "rounds": args.rounds,
            "image-size": config.image_size,
            "lora-rank": config.lora_rank,
            "batch-size": config.batch_size,
            "local-steps": config.local_steps,
            "tap-distill-steps": dict(config.method_values).get("tap-distill-steps"),
            "threads": args.threads,
            "seed": args.seed,
            "run-config": run_config | {"client-state-dir": "<temporary>"},
        },
        "rows": settings,
    }


# ---------------------------------------------------------------------------------------------
# Output


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value / MIB:.2f} MiB"


def table(results: dict[str, Any]) -> str:
    """Markdown: the paper's Table 7 columns plus the measured peak memory, and per group."""
    s = results["settings"]
    rows = results["rows"]
    cuda = "stage1-cuda" in rows[TAP]
    peak = "peak CUDA allocated" if cuda else "peak RSS above imports"
    lines = [
        f"`mm-offline` ({s['image-size']} px, LoRA rank {s['lora-rank']}), {s['num-clients']} "
        f"clients ({len(s['clients-measured'])} measured), batch {s['batch-size']}, "
        f"{s['local-steps']} local steps, {s['rounds']} stage-1 rounds, "
        f"P = {s['tap-distill-steps']}, {s['device']}; setup: {s['setup']}.",
        "",
        f"| Setting | Avg. total params | Avg. % trainable | Avg. memory (params) "
        f"| Avg. {peak}, stage 1 | Avg. {peak}, KD | Avg. KD training time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    key1, key2 = ("stage1-cuda", "stage2-cuda") if cuda else ("stage1-rss", "stage2-rss")
    for label, row in rows.items():
        kd = f"{row['kd-seconds']:.2f}" if "kd-seconds" in row else "—"
        lines.append(
            f"| {label} | {row['total']:,.1f} | {100 * row['trainable-fraction']:.2f}% "
            f"| {_mib(row['held-bytes'])} | {_mib(row[key1])} | {_mib(row.get(key2))} | {kd} |"
        )
    lines += [
        "",
        "| Pairs | Setting | Total params | % trainable | Memory (params) |",
        "|---|---|---:|---:|---:|",
    ]
    for label, row in rows.items():
        seen: set[tuple[str, ...]] = set()
        for client in row["clients"]:
            held = tuple(client["holds"])
            if held in seen:
                continue
            seen.add(held)
            lines.append(
                f"| {'+'.join(held)} | {label} | {client['total']:,} "
                f"| {100 * client['trainable-fraction']:.2f}% | {_mib(client['held-bytes'])} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 clients, short schedules")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--setup", default=None, help="configs/setups/<name>.toml (default: a multitask one)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="stage-1 rounds before stage 2")
    parser.add_argument(
        "--per-group", type=int, default=0, help="clients measured per group; 0 = all"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0 = default")
    parser.add_argument("--cache-dir", default="", help="run-config cache-dir (default: its own)")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="run-config overrides"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda but torch sees no CUDA device")
    if args.rounds < 1 or args.per_group < 0 or args.threads < 0:
        parser.error("--rounds must be positive, --per-group and --threads >= 0")
    if args.cache_dir:
        args.set = [*args.set, f"cache-dir={args.cache_dir}"]
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure both settings; print and write the table and the JSON."""
    args = parse_args(argv)
    from bench.feddpa_inference import machine_info

    started = time.perf_counter()
    results = measure(args)
    results["machine"] = machine_info(args.device)
    results["seconds"] = time.perf_counter() - started
    markdown = table(results)
    name = f"{results['settings']['mode']}-{args.device}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"results-{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / f"table-{name}.md").write_text(markdown + "\n")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
