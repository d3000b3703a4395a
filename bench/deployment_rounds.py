"""Deployment against simulation: round time with N SuperNodes on loopback and with N simulated.

    python -m bench.deployment_rounds --supernodes 2 4 --rounds 3 \
        [--modes cold polling flower-waits warm]

For each N the same FedAvg experiment (N clients, offline setup) runs on a real loopback
deployment from ``fedfm_flower.deploy`` (SuperLink + N SuperNodes, TLS and authentication) in
each mode (``MODES``), then in ``flwr run`` simulation with N SuperNodes:

* ``cold``: node config ``warm-worker=false``: a fresh ``flwr-clientapp`` process does every
  message (before the warm worker), with Flower's SuperNode waits;
* ``polling``: the warm worker (``client_apps.warm``), and run config ``prompt-replies=false``:
  the ServerApp waits with Flower's own ``send_and_receive`` (3 s between pulls), and Flower's
  SuperNode waits;
* ``flower-waits``: the warm worker and prompt replies, with plain ``flower-supernode`` and its
  fixed waits (3 s between empty pulls, SuperExec 1 s);
* ``warm``: warm worker, ``server_apps.polling.PromptGrid`` and SuperNodes started by
  ``fedfm_flower.deploy.supernode`` (idle waits from 0.1 s growing to 1 s), a ``flwr-clientapp``
  process per message (``--no-warm-executor``);
* ``warm-executor``: the defaults: ``warm`` with each node's ClientApp tasks in one kept process
  (``fedfm_flower.deploy.superexec``): no ``flwr-clientapp`` process per message.

Reported: steady-state round time (median of rounds 2..R-1) of each, their ratios to simulation,
whether the modes gave the same metrics, and from the SuperNodes' logs the warm workers' handling
time per message. The ClientApp's cold start per message, which dominates ``cold``, is
``bench.clientapp_cold_start``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.simulation_overhead import run_flower_simulation, steady, usable_cpus
from fedfm_flower.config.overrides import parse_overrides
from fedfm_flower.deploy import DeployOptions, LocalDeployment
from fedfm_flower.deploy.supernode import DEFAULT_POLL_INTERVAL
from fedfm_flower.records.results import RunDirectory

ROOT = Path(__file__).resolve().parent.parent


WORKER_LINE = re.compile(r"warm-worker\[\d+\].* (train|evaluate) message handled in ([0-9.]+) s")
EXECUTOR_LINE = re.compile(r"warm executor: task \d+ \((\w+)\) completed in ([0-9.]+) s")
STAMP = re.compile(r"^\S+ \+\s*([0-9.]+)s (.*)$")
SENDING = re.compile(r"Sending: (\w+) message")


@dataclass(frozen=True)
class Mode:
    """One way of deploying: the row key of its results, its label, and its switches."""

    key: str
    label: str
    warm_worker: bool
    prompt_replies: bool = True
    short_waits: bool = True
    warm_executor: bool = False


MODES = {
    "cold": Mode(
        "per-message-process",
        "per-message process (warm-worker=false)",
        warm_worker=False,
        short_waits=False,
    ),
    "polling": Mode(
        "warm-worker-flower-polling",
        "warm worker, Flower's 3 s reply polling and waits (prompt-replies=false)",
        warm_worker=True,
        prompt_replies=False,
        short_waits=False,
    ),
    "flower-waits": Mode(
        "warm-worker-flower-waits",
        "warm worker and prompt replies, Flower's SuperNode waits (--flower-waits)",
        warm_worker=True,
        short_waits=False,
    ),
    "warm": Mode(
        "warm-worker",
        "warm worker and prompt replies, a process per message (--no-warm-executor)",
        warm_worker=True,
    ),
    "warm-executor": Mode(
        "warm-executor",
        "prompt replies, each node's tasks in one kept process (the defaults)",
        warm_worker=True,
        warm_executor=True,
    ),
}


def this_start(log: str) -> str:
    """The part of a process log written since its last start (logs are appended to)."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("# ") and " $ " in line]
    return "\n".join(lines[starts[-1] :] if starts else lines)


def clientapp_seconds(log: str) -> dict[str, list[float]]:
    """Per message type, the seconds from "Start `flwr-clientapp` process" to the SuperNode's
    "Sending: <type> message" (the reply) in one SuperNode's log: what one message costs."""
    found: dict[str, list[float]] = {}
    started = None
    for line in log.splitlines():
        stamped = STAMP.match(line)
        if not stamped:
            continue
        seconds, text = float(stamped.group(1)), stamped.group(2)
        if "Start `flwr-clientapp` process" in text:
            started = seconds
        elif (sending := SENDING.search(text)) and started is not None:
            found.setdefault(sending.group(1), []).append(seconds - started)
            started = None
    return found


def run_deployment(num_nodes: int, config: dict, workdir: Path, mode: Mode) -> dict[str, Any]:
    """A secure loopback deployment with ``num_nodes`` SuperNodes in ``mode``; round times."""
    name = f"deploy-{num_nodes}-{mode.key}"
    output = workdir / "runs"
    options = DeployOptions(
        num_supernodes=num_nodes,
        workdir=workdir / name,
        echo=False,
        run_timeout=1800,
        node_config={"warm-worker": mode.warm_worker},
        poll_interval=DEFAULT_POLL_INTERVAL if mode.short_waits else None,
        warm_executor=mode.warm_executor,
    )
    shutil.rmtree(output / name, ignore_errors=True)  # results of an earlier invocation
    run_config = {**config, "prompt-replies": mode.prompt_replies}
    with LocalDeployment(options) as deployment:
        deployment.start()
        result = deployment.run({**run_config, "output-dir": str(output), "run-name": name})
    if not result.ok:
        raise RuntimeError(f"deployment run {name} ended {result.status}; log {result.log_path}")
    records = RunDirectory(output / name).rounds()
    seconds = [r["round-seconds"] for r in records]
    logs = [this_start(process.log_path.read_text()) for process in deployment.supernodes]
    handled = [
        float(match.group(2))
        for log in logs
        for match in map(WORKER_LINE.search, log.splitlines())
        if match
    ]
    per_message: dict[str, list[float]] = {}
    for log in logs:
        for kind, times in clientapp_seconds(log).items():
            per_message.setdefault(kind, []).extend(times)
        for match in map(EXECUTOR_LINE.search, log.splitlines()):
            if match:
                per_message.setdefault(match.group(1), []).append(float(match.group(2)))
    return {
        "mode": mode.label,
        "round-s": seconds,
        "steady-round-s": steady(seconds),
        "run-s": result.seconds,
        "start-s": sum(
            deployment.timings.get(k, 0.0) for k in ("superlink-start-s", "supernodes-online-s")
        ),
        "threads-per-process": deployment.threads(),
        "clientapp-s": per_message,
        "clientapp-s-median": {k: statistics.median(v) for k, v in per_message.items()},
        "worker-messages": len(handled),
        "worker-handling-s-median": statistics.median(handled) if handled else None,
        "metrics": [
            {k: r.get(k) for k in ("round", "train-loss-mean", "test-accuracy-mean")}
            for r in records
        ],
    }


def measure(
    nodes: list[int],
    rounds: int,
    config: dict,
    workdir: Path,
    modes: tuple[Mode, ...] = tuple(MODES.values()),
) -> list[dict[str, Any]]:
    """Deployment in each of ``modes`` and simulation for each N; one row per N."""
    rows = []
    for num_nodes in nodes:
        run_config = {**config, "method": "fedavg", "num-server-rounds": rounds}
        deployed = {m.key: run_deployment(num_nodes, run_config, workdir, m) for m in modes}
        simulated = run_flower_simulation(
            num_nodes, rounds, 1, run_config, workdir, f"simulation-{num_nodes}"
        )
        simulation_s = simulated["steady-round-s"]
        row: dict[str, Any] = {
            "supernodes": num_nodes,
            "rounds": rounds,
            "cpus": usable_cpus(),
            "simulation": {k: simulated[k] for k in ("round-s", "steady-round-s", "launch-s")},
        }
        for key, result in deployed.items():
            row[key] = result
            row[f"ratio-{key}"] = result["steady-round-s"] / simulation_s
        main = deployed[modes[-1].key]  # the last mode given
        row["deployment"], row["ratio"] = main, main["steady-round-s"] / simulation_s
        for name, (before, after) in {
            "speedup": ("per-message-process", "warm-worker"),
            "polling-speedup": ("warm-worker-flower-polling", "warm-worker"),
            "waits-speedup": ("warm-worker-flower-waits", "warm-worker"),
            "executor-speedup": ("warm-worker", "warm-executor"),
        }.items():
            if before in deployed and after in deployed:
                row[name] = deployed[before]["steady-round-s"] / deployed[after]["steady-round-s"]
        metrics = [result["metrics"] for result in deployed.values()]
        row["same-metrics"] = all(m == metrics[0] for m in metrics)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: measure and print the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--supernodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "work" / "deployment")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=tuple(MODES),
        default=list(MODES),
        help="deployment modes, measured in this order in one run (default: all)",
    )
    args = parser.parse_args(argv)
    config = {"seed": 0, **parse_overrides(args.set)}
    modes = tuple(MODES[name] for name in args.modes)
    measure(args.supernodes, args.rounds, config, args.workdir, modes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
