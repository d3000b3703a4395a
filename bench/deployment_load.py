"""Deployment under load: how many SuperNodes this machine holds, and what runs out first.

    python -m bench.deployment_load --supernodes 2 4 8 16 30 --rounds 10 [--out results.json]

For each N (in the order given) a secure loopback deployment (SuperLink, N SuperNodes with TLS
and authentication, each with its warm executor: ``fedfm_flower.deploy``) runs ``--rounds``
rounds of FedAvg on the offline default with N clients. While it runs, every process of the
deployment is sampled every 0.5 s: its PSS (shared pages divided among the sharers, so torch's
libraries mapped by N processes are not counted N times) and its CPU seconds. Reported per N:
the peak of the summed PSS, the largest PSS of each role (SuperLink, SuperNode, SuperExec with
its ClientApp, ServerApp, ...), the CPU seconds of each role (``role-cpu-s``: over the whole
deployment; ``role-cpu-s-run``: from when every SuperNode was online, so without the processes'
imports), the start-up time, the steady round time and whether every client reported in every
round.

Before each N the next run's memory is predicted from the last one (its peak plus the
per-SuperNode PSS times the added nodes); when the prediction passes ``--memory-fraction`` of
the memory available now, that N is not started and the row says so: memory is then the limit
measured. A run that fails or times out ends the sweep with its status.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.process_cpu import CpuByRole
from bench.process_memory import PeakMemory
from fedfm_flower.config.overrides import parse_overrides
from fedfm_flower.deploy import DeployOptions, LocalDeployment
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.simulation.processes import exit_on_sigterm, proc_cmdline, proc_stat

MB = 2**20
FORKSERVER = "fedfm_flower.deploy.forkserver"
EXECUTOR = "superexec (warm ClientApp)"
ROLES = (
    ("flower-superlink", "superlink"),
    ("fedfm_flower.deploy.superlink", "superlink"),
    ("fedfm_flower.deploy.superexec", EXECUTOR),
    ("flower-superexec", "superlink's superexec"),
    ("fedfm_flower.deploy.supernode", "supernode"),
    ("flower-supernode", "supernode"),
    ("flwr-serverapp", "serverapp"),
    ("flwr-clientapp", "clientapp process"),
    ("flwr run", "flwr run"),
)


def role_of(pid: int) -> str:
    """The deployment role of a process, from its command line."""
    command = " ".join(proc_cmdline(pid))
    if FORKSERVER in command:  # the server, or a SuperExec it forked (same command line)
        return EXECUTOR if FORKSERVER in " ".join(proc_cmdline(parent_pid(pid))) else "fork server"
    for marker, role in ROLES:
        if marker in command:
            return role
    return "other"


def parent_pid(pid: int) -> int:
    """The parent of a process (0 when it is gone)."""
    fields = proc_stat(pid)
    return int(fields[1]) if fields else 0


def available_bytes() -> int:
    """MemAvailable of this machine."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


class DeploymentSampler(PeakMemory):
    """Samples a deployment's processes in a thread: peak summed PSS, per-role peaks, CPU."""

    def __init__(self, deployment: LocalDeployment, interval: float = 0.5) -> None:
        super().__init__(interval=interval, pids=deployment.live_pids)
        self.role_peak: dict[str, int] = {}
        self.cpu = CpuByRole()

    def observe(self, pid: int, size: int) -> None:
        """A process's role's peak PSS and its CPU seconds so far."""
        role = self.cpu.role(pid) or role_of(pid)
        self.role_peak[role] = max(self.role_peak.get(role, 0), size)
        self.cpu.record(pid, role)


def run_load(
    num_nodes: int,
    rounds: int,
    workdir: Path,
    config: dict[str, Any],
    deploy: Mapping[str, Any] | None = None,
    idle_s: float = 0.0,
) -> dict[str, Any]:
    """One deployment of ``num_nodes`` SuperNodes running ``rounds`` FedAvg rounds (``deploy``:
    ``DeployOptions`` fields, e.g. ``superlink_database``, ``shared_imports``); its row. With
    ``idle_s`` the federation first idles that long, every node online and no run, and the row
    has each role's CPU seconds over that window (``role-cpu-s-idle``): what waiting costs."""
    name = f"load-{num_nodes}"
    output = workdir / "runs"
    fields: dict[str, Any] = {
        "startup_timeout": 60.0 + 10.0 * num_nodes,
        "run_timeout": 600.0 + 60.0 * num_nodes,
        "warm_executor": True,
        **(deploy or {}),
    }
    options = DeployOptions(num_supernodes=num_nodes, workdir=workdir / name, echo=False, **fields)
    run_config = {
        **config,
        "method": "fedavg",
        "num-server-rounds": rounds,
        "output-dir": str(output),
        "run-name": name,
    }
    deployment = LocalDeployment(options)
    started = time.monotonic()
    try:
        with DeploymentSampler(deployment) as sampler:
            deployment.start()
            online = time.monotonic() - started
            at_start = sampler.cpu.by_role()
            if idle_s > 0:
                time.sleep(idle_s + sampler.interval)  # the window's last sample included
                idle = sampler.cpu.by_role()
                idle_cpu = {k: round(v - at_start.get(k, 0.0), 2) for k, v in idle.items()}
                at_start = idle
            result = deployment.run(run_config)
    finally:
        deployment.stop()
    row: dict[str, Any] = {
        "supernodes": num_nodes,
        **({"idle-s": idle_s, "role-cpu-s-idle": idle_cpu} if idle_s > 0 else {}),
        "superlink-database": options.superlink_database or "sqlite file",
        "superlink-lock-wait-s": options.superlink_lock_wait,
        "pull-patience-s": options.pull_patience,
        "shared-imports": options.shared_imports,
        "max-poll-interval-s": options.max_poll_interval,
        "run-timeout-s": options.run_timeout,
        "status": result.status,
        "start-s": online,
        "run-s": result.seconds,
        "threads-per-process": deployment.threads(),
        "peak-pss-mb": sampler.peak_bytes / MB,
        "peak-processes": sampler.peak_processes,
        "role-peak-pss-mb": {k: v / MB for k, v in sorted(sampler.role_peak.items())},
        "role-cpu-s": {k: round(v, 1) for k, v in sorted(sampler.cpu.by_role().items())},
        "role-cpu-s-run": {
            k: round(v - at_start.get(k, 0.0), 1) for k, v in sorted(sampler.cpu.by_role().items())
        },
    }
    if result.ok:
        records = RunDirectory(output / name).rounds()
        seconds = [r["round-seconds"] for r in records]
        row["round-s"] = seconds
        row["steady-round-s"] = statistics.median(seconds[1:] or seconds)
        row["all-clients-every-round"] = all(r["clients-reported"] == num_nodes for r in records)
        row["final-test-accuracy-mean"] = records[-1].get("test-accuracy-mean")
    return row


def predicted_bytes(last: dict[str, Any], num_nodes: int) -> float:
    """The next run's peak PSS from the last row: its peak plus its per-node share per node."""
    per_node = last["peak-pss-mb"] * MB / (last["supernodes"] + 1)
    return last["peak-pss-mb"] * MB + per_node * (num_nodes - last["supernodes"])


def sweep(
    nodes: list[int],
    rounds: int,
    workdir: Path,
    config: dict[str, Any],
    memory_fraction: float,
    deploy: Mapping[str, Any] | None = None,
    idle_s: float = 0.0,
) -> list[dict[str, Any]]:
    """``run_load`` for each N until memory would run out or a run fails."""
    rows: list[dict[str, Any]] = []
    for num_nodes in nodes:
        if rows:
            need, have = predicted_bytes(rows[-1], num_nodes), available_bytes()
            if need > memory_fraction * have:
                rows.append(
                    {
                        "supernodes": num_nodes,
                        "status": "not-started: memory",
                        "predicted-pss-mb": need / MB,
                        "available-mb": have / MB,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
                break
        rows.append(run_load(num_nodes, rounds, workdir, config, deploy, idle_s))
        print(json.dumps(rows[-1]), flush=True)
        if rows[-1]["status"] != "finished:completed":
            break
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The sweep as a Markdown table."""
    lines = [
        "| SuperNodes | status | start (s) | steady round (s) | all clients | peak PSS (MB) "
        "| per SuperExec (MB) | SuperLink (MB) | ServerApp (MB) | CPU s: SuperExecs / SuperLink "
        "/ ServerApp / SuperNodes |",
        "|---:|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        if "peak-pss-mb" not in row:
            lines.append(
                f"| {row['supernodes']} | {row['status']} (predicted "
                f"{row['predicted-pss-mb']:.0f} MB, available {row['available-mb']:.0f} MB) "
                "| | | | | | | | |"
            )
            continue
        peaks, cpu = row["role-peak-pss-mb"], row["role-cpu-s"]
        executor = EXECUTOR
        lines.append(
            f"| {row['supernodes']} | {row['status']} | {row['start-s']:.0f} "
            f"| {row.get('steady-round-s', float('nan')):.2f} "
            f"| {row.get('all-clients-every-round', '-')} | {row['peak-pss-mb']:.0f} "
            f"| {peaks.get(executor, 0):.0f} | {peaks.get('superlink', 0):.0f} "
            f"| {peaks.get('serverapp', 0):.0f} "
            f"| {cpu.get(executor, 0):.0f} / {cpu.get('superlink', 0):.0f} / "
            f"{cpu.get('serverapp', 0):.0f} / {cpu.get('supernode', 0):.0f} |"
        )
    return "\n".join(lines)


def deploy_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``DeployOptions`` fields the command line sets."""
    deploy: dict[str, Any] = {
        "superlink_database": args.superlink_database,
        "pull_patience": args.pull_patience,
        "shared_imports": args.shared_imports,
    }
    if args.flower_superlink:
        deploy["superlink_lock_wait"] = None
    if args.max_poll_interval is not None:
        deploy["max_poll_interval"] = args.max_poll_interval
    if args.run_timeout is not None:
        deploy["run_timeout"] = args.run_timeout
    return deploy


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; print the table; write the rows to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--supernodes", type=int, nargs="+", default=[2, 4, 8, 16, 30])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--memory-fraction", type=float, default=0.8)
    parser.add_argument("--workdir", type=Path, default=Path("bench/work/deployment-load"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--superlink-database",
        default=None,
        help="the SuperLink's --database (default: a fresh SQLite file; :flwr-in-memory:)",
    )
    parser.add_argument(
        "--flower-superlink",
        action="store_true",
        help="plain flower-superlink (SQLite lock wait 5 s, a token sweep per status read)",
    )
    parser.add_argument(
        "--pull-patience",
        type=float,
        default=None,
        help="seconds a warm executor waits for its message's next object (default 90)",
    )
    parser.add_argument(
        "--shared-imports",
        action="store_true",
        help="fork the warm executors from one process that imported their libraries once",
    )
    parser.add_argument(
        "--max-poll-interval",
        type=float,
        default=None,
        help="the SuperNodes' longest idle wait in seconds (default 1)",
    )
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        help="seconds for each run (default 600 + 60 per SuperNode)",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=0.0,
        help="idle the federation this long before the run and report each role's CPU then",
    )
    args = parser.parse_args(argv)
    exit_on_sigterm()  # a killed bench stops its deployment (finally) instead of leaving it
    if any(n < 1 for n in args.supernodes) or args.rounds < 1:
        parser.error("--supernodes and --rounds must be >= 1")
    if not 0 <= args.idle_seconds <= 3600:
        parser.error(f"--idle-seconds must lie in [0, 3600], not {args.idle_seconds}")
    if not 0 < args.memory_fraction <= 1:
        parser.error(f"--memory-fraction must lie in (0, 1], not {args.memory_fraction}")
    try:
        config = parse_overrides(args.set)  # partitioner=iid and partitioner='iid' alike
    except ValueError as err:
        parser.error(str(err))
    rows = sweep(
        args.supernodes,
        args.rounds,
        args.workdir,
        config,
        args.memory_fraction,
        deploy_overrides(args),
        args.idle_seconds,
    )
    print(table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "rows": rows,
            "rounds": args.rounds,
            "machine": {
                "platform": platform.platform(),
                "python": sys.version.split()[0],
                "memory-available-mb-at-end": available_bytes() / MB,
            },
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["status"] == "finished:completed" for r in rows if "peak-pss-mb" in r) else 1


if __name__ == "__main__":
    sys.exit(main())
