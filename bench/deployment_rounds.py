"""Deployment against simulation: round time with N SuperNodes on loopback and with N simulated.

    python -m bench.deployment_rounds --supernodes 2 4 --rounds 3

For each N the same FedAvg experiment (N clients, offline setup) runs (a) on a real loopback
deployment from ``fedfm_flower.deploy`` (SuperLink + N SuperNodes, TLS and authentication,
a fresh ``flwr-clientapp`` process per message) and (b) in ``flwr run`` simulation with N
SuperNodes. Reported: steady-state round time (median of rounds 2..R) of each and their ratio.
The ClientApp's cold start per message, which dominates (a), is ``bench.clientapp_cold_start``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from bench.simulation_overhead import run_flower_simulation, steady, usable_cpus
from fedfm_flower.deploy import DeployOptions, LocalDeployment
from fedfm_flower.overrides import parse_overrides
from fedfm_flower.results import RunDirectory

ROOT = Path(__file__).resolve().parent.parent


def run_deployment(num_nodes: int, config: dict, workdir: Path) -> dict[str, Any]:
    """A secure loopback deployment with ``num_nodes`` SuperNodes; round times."""
    name = f"deploy-{num_nodes}"
    output = workdir / "runs"
    options = DeployOptions(
        num_supernodes=num_nodes, workdir=workdir / name, echo=False, run_timeout=1800
    )
    shutil.rmtree(output / name, ignore_errors=True)  # results of an earlier invocation
    with LocalDeployment(options) as deployment:
        deployment.start()
        result = deployment.run({**config, "output-dir": str(output), "run-name": name})
    if not result.ok:
        raise RuntimeError(f"deployment run {name} ended {result.status}; log {result.log_path}")
    records = RunDirectory(output / name).rounds()
    seconds = [r["round-seconds"] for r in records]
    return {
        "round-s": seconds,
        "steady-round-s": steady(seconds),
        "run-s": result.seconds,
        "start-s": sum(
            deployment.timings.get(k, 0.0) for k in ("superlink-start-s", "supernodes-online-s")
        ),
        "threads-per-process": deployment.threads(),
    }


def measure(nodes: list[int], rounds: int, config: dict, workdir: Path) -> list[dict[str, Any]]:
    """Deployment and simulation for each N; one row per N."""
    rows = []
    for num_nodes in nodes:
        run_config = {**config, "method": "fedavg", "num-server-rounds": rounds}
        deployed = run_deployment(num_nodes, run_config, workdir)
        simulated = run_flower_simulation(
            num_nodes, rounds, 1, run_config, workdir, f"simulation-{num_nodes}"
        )
        rows.append(
            {
                "supernodes": num_nodes,
                "rounds": rounds,
                "cpus": usable_cpus(),
                "deployment": deployed,
                "simulation": {k: simulated[k] for k in ("round-s", "steady-round-s", "launch-s")},
                "ratio": deployed["steady-round-s"] / simulated["steady-round-s"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: measure and print the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--supernodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "work" / "deployment")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    measure(args.supernodes, args.rounds, {"seed": 0, **parse_overrides(args.set)}, args.workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
