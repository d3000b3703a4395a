"""What one training message costs a ``flwr-clientapp`` process, with and without a warm worker.

    python -m bench.warm_worker_message [--method fedavg] [--repeats 3]

The parent builds one round-1 training message of ``method`` (its own strategy, through the
in-process grid) and the node's context, and writes both as Flower protobufs. Each repeat starts
a fresh interpreter that does what ``flwr-clientapp`` does around our ClientApp: it imports
Flower's ClientApp runtime and ``client_apps.app``, reads the message and the context, and
handles the message in one of four ways:

* ``cold``: in this process, no worker (``warm-worker=false``; every message before);
* ``warm``: forwarded to a worker that is running and has handled a message before;
* ``first-wait``: no worker running; the process starts one and waits for it (what
  ``client_apps.warm`` does);
* ``first-here``: no worker running; the process starts one but handles the message itself
  while the worker starts beside it (the alternative it rejected).

Reported per scenario, medians over the repeats (seconds): ``total``, the process's wall time
from spawn to exit; ``imports``, Flower's runtime and our ClientApp; ``handling``, from having
the message to having the reply. Flower's own pulling and pushing of the message through the
SuperNode is not in these figures (it is the same with and without a worker). Writes
``bench/results/warm_worker_message/{results.json,table.md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("cold", "warm", "first-wait", "first-here")


def child(scenario: str, directory: str, key: str, files: str, watch: int, spawned: float) -> None:
    """Handle the saved message in this fresh process; print the phase times as JSON."""
    first_line = time.time()
    started = time.perf_counter()
    import flwr.supernode.cli.flwr_clientapp  # noqa: F401 - what flwr-clientapp imports
    from flwr.common.serde import context_from_proto, message_from_proto
    from flwr.proto.message_pb2 import Context as ProtoContext
    from flwr.proto.message_pb2 import Message as ProtoMessage

    from client_apps import warm
    from client_apps.app import app

    imported = time.perf_counter()
    message = message_from_proto(ProtoMessage.FromString(Path(files, "message.pb").read_bytes()))
    context = context_from_proto(ProtoContext.FromString(Path(files, "context.pb").read_bytes()))
    endpoint = warm.Endpoint(Path(directory), key)
    spawn = warm.SpawnSpec((watch,), idle_s=600)
    here = []

    def in_process(message, context):  # noqa: ANN001, ANN202
        here.append(True)
        return app(message, context)

    ready = time.perf_counter()
    if scenario == "cold":
        reply = in_process(message, context)
    elif scenario == "warm":
        reply = warm.handle(message, context, in_process, endpoint, None)
    else:
        wait_s = warm.READY_WAIT_S if scenario == "first-wait" else 0.0
        reply = warm.handle(message, context, in_process, endpoint, spawn, wait_s=wait_s)
    handled = time.perf_counter()
    if reply.has_error():
        raise SystemExit(f"{scenario}: the message failed")
    print(
        json.dumps(
            {
                "interpreter": first_line - spawned,
                "imports": imported - started,
                "handling": handled - ready,
                "in-process": bool(here),
            }
        )
    )


def build_message(method: str, cache_dir: str, out: Path) -> None:
    """Write a round-1 training message of ``method`` and its node's context as protobufs."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.common.serde import context_to_proto, message_to_proto

    from client_apps.app import app
    from fedfm_flower.config.experiment import ExperimentConfig
    from server_apps.inprocess import InProcessGrid, simulation_node_configs
    from server_apps.runner import build_strategy

    config = ExperimentConfig.from_run_config(
        {**ExperimentConfig().to_run_config(), "method": method, "cache-dir": cache_dir}
    ).replace(num_clients=10)
    node_config = simulation_node_configs(10)[0]
    grid = InProcessGrid(app, config.to_run_config(), [node_config])
    strategy = build_strategy(config)
    strategy.learn_node_mapping(grid, 1)
    message = next(iter(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid)))
    message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    context = Context(1, message.metadata.dst_node_id, node_config, RecordDict(), grid.run_config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "message.pb").write_bytes(message_to_proto(message).SerializeToString())
    (out / "context.pb").write_bytes(context_to_proto(context).SerializeToString())


def run_child(scenario: str, key: str, files: Path) -> dict[str, float]:
    """One fresh process for ``scenario``: its phase times and total wall time."""
    from client_apps import warm

    spawned = time.time()
    command = [sys.executable, "-m", "bench.warm_worker_message", "--child", scenario]
    command += [str(warm.private_directory()), key, str(files), str(os.getpid()), str(spawned)]
    # Files, not pipes: a worker the child starts inherits its output and outlives it.
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        code = subprocess.run(command, cwd=ROOT, stdout=stdout, stderr=stderr).returncode
        total = time.time() - spawned
        stdout.seek(0)
        stderr.seek(0)
        output, errors = stdout.read().decode(), stderr.read().decode(errors="replace")
    if code != 0:
        raise RuntimeError(f"{scenario}: child failed:\n{errors[-3000:]}")
    phases = json.loads(output.strip().splitlines()[-1])
    phases["total"] = total
    return phases


def stop_worker(key: str) -> None:
    """Kill the worker of ``key`` (if any) and remove its files."""
    from client_apps import warm

    endpoint = warm.Endpoint.for_key(key)
    pid = endpoint.worker_pid()
    if pid is not None and warm.process_alive(pid):
        os.kill(pid, signal.SIGKILL)
        while warm.process_alive(pid):
            time.sleep(0.05)
    for path in endpoint.files():
        path.unlink(missing_ok=True)


def measure(method: str, repeats: int, cache_dir: str, files: Path) -> dict[str, list[dict]]:
    """Every scenario ``repeats`` times; the raw phase times per scenario."""
    from client_apps import warm

    key = f"bench-{uuid.uuid4().hex[:12]}"
    results: dict[str, list[dict]] = {}
    try:
        for scenario in SCENARIOS:
            runs = []
            for _ in range(repeats):
                if scenario == "warm" and warm.ping(warm.Endpoint.for_key(key)) != warm.OK:
                    stop_worker(key)
                    run_child("first-wait", key, files)  # a worker that has handled a message
                elif scenario.startswith("first"):
                    stop_worker(key)
                runs.append(run_child(scenario, key, files))
                if scenario == "first-here":
                    stop_worker(key)  # it started beside the message; the next repeat is cold
                expect_here = scenario in ("cold", "first-here")
                if runs[-1]["in-process"] != expect_here:
                    raise RuntimeError(f"{scenario}: handled in-process = {not expect_here}")
            results[scenario] = runs
            total = statistics.median(r["total"] for r in runs)
            print(f"{scenario}: {total:.2f} s per message", flush=True)
    finally:
        stop_worker(key)
    return results


def table(results: dict[str, list[dict]]) -> str:
    """Markdown table of the median phase times per scenario."""
    lines = ["| scenario | imports | handling | total |", "|---|---:|---:|---:|"]
    for scenario, runs in results.items():
        cells = [f"{statistics.median(r[p] for r in runs):.2f}" for p in ("imports", "handling")]
        total = statistics.median(r["total"] for r in runs)
        lines.append(f"| {scenario} | {' | '.join(cells)} | {total:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Measure every scenario; print and write the table."""
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        scenario, directory, key, files, watch, spawned = sys.argv[2:8]
        child(scenario, directory, key, files, int(watch), float(spawned))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="fedavg")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "fedfm-flower"))
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "warm_worker_message"
    )
    args = parser.parse_args(argv)
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.models.foundation import foundation_card

    foundation_card(ExperimentConfig(cache_dir=args.cache_dir))  # build or find it once
    files = Path(tempfile.mkdtemp(prefix="warm-worker-bench-"))
    try:
        build_message(args.method, args.cache_dir, files)
        results = measure(args.method, args.repeats, args.cache_dir, files)
    finally:
        shutil.rmtree(files, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    markdown = table(results)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    payload = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit.stdout.strip(),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load-average": os.getloadavg(),
        },
        "method": args.method,
        "repeats": args.repeats,
        "results": results,
    }
    (args.out / "results.json").write_text(json.dumps(payload, indent=2))
    (args.out / "table.md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
