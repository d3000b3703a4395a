"""Deploy the Flower App on this machine over loopback: one SuperLink, N SuperNodes, one run.

The command line of ``fedfm_flower.deploy`` (``python -m fedfm_flower.deploy``,
``scripts/deploy_local.py``, ``scripts/deploy_local.sh``): it checks the run config before
anything starts (a problem is one line on stderr), starts the federation, runs, and stops every
process it started on success, on error, on Ctrl-C and on SIGTERM/SIGHUP. Exit status
(``fedfm_flower.simulation.verdict.ExitCode``): 0 run completed, 1 run failed or stopped, 2 bad
arguments, run config or a Flower command not found
(``fedfm_flower.simulation.processes.flower_command``), 3 the deployment could not start, 124
``--run-timeout`` reached, 130 interrupted.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from fedfm_flower.deploy.local import FLOWER_COMMANDS, LocalDeployment
from fedfm_flower.deploy.options import (
    CONNECTION,
    DEFAULT_BASE_PORT,
    ROOT,
    DeploymentError,
    DeployOptions,
)
from fedfm_flower.deploy.processes import become_subreaper
from fedfm_flower.deploy.runs import RunConfigError, parse_run_config, resolve_run_config
from fedfm_flower.deploy.superlink import DEFAULT_LOCK_WAIT_S
from fedfm_flower.deploy.supernode import DEFAULT_MAX_POLL_INTERVAL, DEFAULT_POLL_INTERVAL
from fedfm_flower.simulation.preflight import PreflightError, check_run, resolve_config
from fedfm_flower.simulation.processes import FlowerCommandNotFound, flower_command
from fedfm_flower.simulation.verdict import ExitCode


class _Terminated(Exception):
    """SIGTERM or SIGHUP arrived."""


def _raise_terminated(signum: int, _frame: object) -> None:
    raise _Terminated(signal.Signals(signum).name)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command-line interface (``prog``: the command's name in usage; default argv[0])."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.splitlines()[0],
        epilog="See docs/deployment.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--num-supernodes", type=int, default=2, help="SuperNodes (= clients)")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=ROOT / "deploy" / "work",
        help="state, logs, certificates, keys, FLWR_HOME (default: deploy/work)",
    )
    parser.add_argument(
        "--run-config",
        action="append",
        default=[],
        metavar="'k=v ...' | FILE.toml",
        help="run-config overrides; repeatable, merged in order (num-clients is set to N)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="no TLS and no SuperNode authentication (local debugging only)",
    )
    parser.add_argument(
        "--base-port",
        type=int,
        default=None,
        help=f"SuperLink port; SuperNode i uses base+1+i (default {DEFAULT_BASE_PORT}, "
        "or the next free block of 100)",
    )
    parser.add_argument("--certs-dir", type=Path, help="existing ca.crt, server.crt, server.key")
    parser.add_argument("--keys-dir", type=Path, help="existing supernode_<i>(.pub) key pairs")
    parser.add_argument("--app", type=Path, default=ROOT, help="the Flower App directory")
    parser.add_argument(
        "--startup-timeout", type=float, default=60.0, help="seconds for the SuperLink/SuperNodes"
    )
    parser.add_argument("--run-timeout", type=float, default=None, help="seconds for the run")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OpenMP/torch threads of the ServerApp and of each ClientApp "
        "(default: CPUs / (N + 1), at least 1; OMP_NUM_THREADS in the environment wins)",
    )
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="after the run, keep the SuperLink and SuperNodes until Ctrl-C",
    )
    parser.add_argument("--no-run", action="store_true", help="start the federation only")
    parser.add_argument(
        "--no-warm-worker",
        action="store_true",
        help="node config warm-worker=false: a fresh ClientApp process does every message",
    )
    parser.add_argument(
        "--no-warm-executor",
        action="store_true",
        help="a flwr-clientapp process per message (Flower's SuperExec) instead of each node's "
        "tasks in one kept process (fedfm_flower.deploy.superexec); --flower-waits implies it",
    )
    parser.add_argument(
        "--shared-imports",
        action="store_true",
        help="fork every warm executor from one process that imported torch, timm, peft and "
        "Flower once (fedfm_flower.deploy.forkserver): less memory per SuperNode when many run "
        "on one machine",
    )
    waits = parser.add_mutually_exclusive_group()
    waits.add_argument(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_INTERVAL,
        help="shortest wait of the SuperNodes, and the SuperExecs' task polling, in seconds "
        f"(default {DEFAULT_POLL_INTERVAL}; Flower's own: 3 s and 1 s)",
    )
    parser.add_argument(
        "--max-poll-interval",
        type=float,
        default=DEFAULT_MAX_POLL_INTERVAL,
        help="longest idle wait of the SuperNodes, in seconds "
        f"(default {DEFAULT_MAX_POLL_INTERVAL})",
    )
    parser.add_argument(
        "--superlink-database",
        default=None,
        help="the SuperLink's --database (default: a fresh SQLite file in the work directory; "
        ":flwr-in-memory: keeps its state in memory, faster under load, lost on a restart)",
    )
    parser.add_argument(
        "--superlink-lock-wait",
        type=float,
        default=DEFAULT_LOCK_WAIT_S,
        help="seconds the SuperLink's SQLite state waits for its write lock (default "
        f"{DEFAULT_LOCK_WAIT_S:g}; fedfm_flower.deploy.superlink)",
    )
    parser.add_argument(
        "--flower-superlink",
        action="store_true",
        help="plain flower-superlink: SQLite waits 5 s for its lock, sweeps tokens on every read",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=None,
        help="the SuperNodes' heartbeat interval in seconds, >= 10; a crashed node is marked "
        "offline after twice it (default: Flower's 30)",
    )
    waits.add_argument(
        "--flower-waits",
        action="store_true",
        help="plain flower-supernode with Flower's own fixed waits",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks (of the checks and of the run)"
    )
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Start, run, stop; returns the exit status."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        options = DeployOptions(
            num_supernodes=args.num_supernodes,
            workdir=args.workdir,
            app_dir=args.app,
            base_port=args.base_port,
            insecure=args.insecure,
            certs_dir=args.certs_dir,
            keys_dir=args.keys_dir,
            startup_timeout=args.startup_timeout,
            run_timeout=args.run_timeout,
            threads=args.threads,
            debug=args.debug,
            node_config={"warm-worker": False} if args.no_warm_worker else {},
            poll_interval=None if args.flower_waits else args.poll_interval,
            max_poll_interval=args.max_poll_interval,
            warm_executor=not args.no_warm_executor,
            shared_imports=args.shared_imports,
            heartbeat_interval=args.heartbeat_interval,
            superlink_database=args.superlink_database,
            superlink_lock_wait=None if args.flower_superlink else args.superlink_lock_wait,
        )
    except ValueError as err:
        parser.error(str(err))
    try:  # everything about the run that can be checked before a process starts
        for command in FLOWER_COMMANDS:
            flower_command(command)
        overrides = parse_run_config(args.run_config)
        resolved = resolve_run_config(overrides, options.num_supernodes, options.app_dir)
        if not args.no_run:
            found = check_run(resolve_config(options.app_dir, resolved), options.num_supernodes)
            for note in found.notes:
                print(f"[check] {note}", flush=True)
    except (FlowerCommandNotFound, RunConfigError, PreflightError) as err:
        if args.debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    if args.insecure:
        print("WARNING: --insecure: no TLS, no SuperNode authentication; local debugging only")
    become_subreaper()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    signal.signal(signal.SIGTERM, _raise_terminated)
    signal.signal(signal.SIGHUP, _raise_terminated)
    deployment = LocalDeployment(options)
    code = ExitCode.COMPLETED
    try:
        deployment.start()
        if not args.no_run:
            result = deployment.run(overrides)
            code = result.exit_code
            if result.ok and result.run_dir is not None:
                print(f"results: {result.run_dir}")
            elif not result.ok:
                print(
                    f"error: run {result.run_id} {result.status}: "
                    f"{result.details or 'no details'}; log {result.log_path}",
                    file=sys.stderr,
                    flush=True,
                )
        if args.keep_running or args.no_run:
            deployment.say(
                f"running: connection '{CONNECTION}' in FLWR_HOME={deployment.flwr_home} "
                f"(address {deployment.address}); Ctrl-C stops everything"
            )
            while all(p.alive() for p in [deployment.superlink, *deployment.supernodes] if p):
                time.sleep(1.0)
            deployment.say("a SuperLink/SuperNode process exited; stopping")
    except DeploymentError as err:
        print(f"error: {err}", file=sys.stderr)
        code = ExitCode.NOT_STARTED
    except (KeyboardInterrupt, _Terminated) as err:
        reason = "SIGINT" if isinstance(err, KeyboardInterrupt) else str(err)
        print(f"\ninterrupted ({reason}); stopping everything", file=sys.stderr)
        code = ExitCode.INTERRUPTED
    finally:
        deployment.stop()
        timings = ", ".join(f"{k} {v:.1f}" for k, v in deployment.timings.items())
        deployment.say(f"stopped; timings: {timings or 'none'}; logs in {deployment.logs}")
    return code
