"""Start-up of a simulation: where the seconds before round 1 and round 1's extra go.

    python -m bench.startup --repeats 2 --rounds 4 [--env KEY=VALUE ...] [--out FILE.json]

Runs the launcher (``python -m fedfm_flower.simulation --num-supernodes 10``, the main job's
config with ``--rounds`` rounds, a private FLWR_HOME and output directory) ``--repeats`` times
in fresh processes and stamps every line of its output with the seconds since the launcher
started. Reported per run, as seconds since start:

* ``checked``: the launcher's checks done (its ``[check]`` line);
* ``run-submitted``: ``flwr run`` has its local SuperLink and submitted the run;
* ``simulation-started``: Flower's simulation process is up (``Starting Flower Simulation``);
* ``server-ready``: the ServerApp built its strategy (its ``run <name>: method`` line);
* ``round-1-done``, ``exit``;

and, from the run's ``metrics.jsonl``: ``launch-s`` (when round 1 started: its ``round-1-done``
stamp less its seconds), ``first-round-extra-s`` (round 1 less the median of rounds 2..R-1)
and their sum, the figure issue 52 targets; ``cpu-s``: CPU seconds per role (``ROLES``: the
launcher, Flower's CLI, SuperLink, SuperExec, the simulation process that runs the ServerApp,
Ray's own processes, Ray's workers: the actors and idle workers; or the fork server and its
workers) when round 1 ended and at the exit, and ``processes``, how many each role had, from
``/proc`` every 0.2 s over the processes carrying the run's tag variable;
``pss-mib-at-round-1``: each role's memory (PSS) then. ``--env`` sets variables for the
launcher (``FEDFM_SIMULATION_ENGINE=ray`` compares Ray's actors with the forked workers).
Measure on an idle machine: on 2 cores anything else running shows in every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from bench.process_cpu import CpuByRole
from bench.process_memory import pss_bytes
from fedfm_flower.records.results import RunDirectory
from fedfm_flower.simulation.processes import pids_with_environment, proc_cmdline

ROOT = Path(__file__).resolve().parent.parent
MARKS = {
    "checked": re.compile(r"^\[check\]"),
    "run-submitted": re.compile(r"Successfully started run"),
    "simulation-started": re.compile(r"Starting Flower Simulation"),
    "server-ready": re.compile(r"INFO fedfm_flower: run \S+: method"),
    "round-1-done": re.compile(r"^\[round +1/"),
}


# (marker in the command line, role), first match wins; Ray's workers are "ray::<what runs>".
ROLES = (
    ("fedfm_flower.simulation ", "launcher"),
    ("bin/flwr ", "flwr cli"),
    ("flower-superlink", "superlink"),
    ("flower-superexec", "superexec"),
    ("flwr-simulation", "simulation (serverapp)"),
    ("fedfm_flower.deploy.forkserver", "fork server and workers"),  # workers keep its cmdline
    ("ray::DashboardAgent", "ray"),
    ("ray::RuntimeEnvAgent", "ray"),
    ("ray::", "ray workers"),
    ("default_worker.py", "ray workers"),  # a worker before it names itself ray::<task>
    ("/ray/", "ray"),
)
TAG = "FEDFM_STARTUP_TAG"


def startup_role(command: str) -> str:
    """The role of a process of the run, from its command line."""
    return next((role for marker, role in ROLES if marker in command), "other")


class RoleCpu(threading.Thread):
    """Samples the CPU seconds of every process tagged ``TAG=tag``, by role, until stopped."""

    def __init__(self, tag: str, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.tag, self.interval = tag, interval
        self.cpu = CpuByRole()
        self.stopped = threading.Event()
        self.at_round_1: dict[str, float] = {}
        self.pss_mib_at_round_1: dict[str, float] = {}

    def run(self) -> None:
        """Sample until ``stop``."""
        while not self.stopped.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        """Read every tagged process's CPU seconds (a process that is gone keeps its last)."""
        for pid in pids_with_environment({TAG: self.tag}):
            command = " ".join(proc_cmdline(pid))  # Ray's workers rename themselves
            role = startup_role(command) if command else self.cpu.role(pid) or "other"
            self.cpu.record(pid, role)

    def by_role(self) -> dict[str, float]:
        """CPU seconds per role so far (rounded to 0.01 s), and their ``total``."""
        totals = self.cpu.by_role()
        totals["total"] = sum(totals.values())
        return {role: round(value, 2) for role, value in sorted(totals.items())}

    def processes(self) -> dict[str, int]:
        """How many processes of each role were seen."""
        return self.cpu.processes()

    def mark_round_1(self) -> None:
        """Keep the CPU seconds per role as they are now, when round 1 has ended, and each
        role's memory (PSS, MiB: shared pages divided among the processes sharing them)."""
        self.sample()
        self.at_round_1 = self.by_role()
        memory: dict[str, float] = {}
        for pid in pids_with_environment({TAG: self.tag}):
            role = self.cpu.role(pid) or "other"
            memory[role] = memory.get(role, 0.0) + pss_bytes(pid) / 2**20
        memory["total"] = sum(memory.values())
        self.pss_mib_at_round_1 = {role: round(v, 1) for role, v in sorted(memory.items())}

    def stop(self) -> None:
        """Stop sampling after one last sample."""
        self.stopped.set()
        if self.ident is not None:  # started
            self.join()
        self.sample()


def stamped_run(
    command: list[str], env: dict[str, str], cpu: RoleCpu | None = None
) -> tuple[dict[str, float], float, int]:
    """First time (s since start) each mark's line appeared, the exit time and exit status;
    ``cpu``, sampling the run's processes, is read when round 1 ends."""
    started = time.perf_counter()
    seen: dict[str, float] = {}
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    assert process.stdout is not None
    for line in process.stdout:
        now = time.perf_counter() - started
        for mark, pattern in MARKS.items():
            if mark not in seen and pattern.search(line):
                seen[mark] = round(now, 2)
                if mark == "round-1-done" and cpu is not None:
                    cpu.mark_round_1()
    code = process.wait()
    return seen, round(time.perf_counter() - started, 2), code


def one_run(rounds: int, extra_env: dict[str, str], workdir: Path, name: str) -> dict:
    """One launch of the main job with ``rounds`` rounds; its stamps and round times."""
    tag = uuid.uuid4().hex
    env = {**os.environ, **extra_env, "FLWR_HOME": str(workdir / f"flwr-home-{name}"), TAG: tag}
    out = workdir / "runs"
    command = [
        sys.executable,
        "-m",
        "fedfm_flower.simulation",
        "--num-supernodes",
        "10",
        "--",
        "-c",
        f"num-server-rounds={rounds} output-dir='{out}' run-name='{name}'",
    ]
    cpu = RoleCpu(tag)
    cpu.start()
    try:
        marks, exit_s, code = stamped_run(command, env, cpu)
    finally:
        cpu.stop()
    run_dir = out / name
    records = RunDirectory(run_dir).rounds() if (run_dir / "metrics.jsonl").exists() else []
    seconds = [r["round-seconds"] for r in records]
    result: dict = {"exit-status": code, "marks": marks, "exit": exit_s, "round-s": seconds}
    result["cpu-s-at-round-1"] = cpu.at_round_1
    result["pss-mib-at-round-1"] = cpu.pss_mib_at_round_1
    result["cpu-s-at-exit"] = cpu.by_role()
    result["processes"] = cpu.processes()
    if code == 0 and len(seconds) >= 3 and "round-1-done" in marks:
        steady = statistics.median(seconds[1:-1])
        result["launch-s"] = round(marks["round-1-done"] - seconds[0], 2)
        result["first-round-extra-s"] = round(seconds[0] - steady, 2)
        result["steady-round-s"] = round(steady, 3)
        result["launch-plus-extra-s"] = round(result["launch-s"] + result["first-round-extra-s"], 2)
        result["final-accuracy"] = records[-1].get("test-accuracy-mean")
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the launches; print one JSON line per run and write them all to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error(
            f"--rounds must be >= 3 (a steady round between first and last): {args.rounds}"
        )
    extra = dict(item.split("=", 1) for item in args.env)
    runs = []
    with tempfile.TemporaryDirectory(prefix="fedfm-startup-") as tmp:
        for repeat in range(args.repeats):
            run = one_run(args.rounds, extra, Path(tmp), f"startup-{repeat}")
            run["env"] = extra
            print(json.dumps(run), flush=True)
            runs.append(run)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(runs, indent=1) + "\n")
    return 0 if all(r["exit-status"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
