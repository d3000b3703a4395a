"""Run the Flower App in local simulation with `flwr run`, and clean up what that started.

``python -m fedfm_flower.simulation --num-supernodes 10 -- [flwr run args]`` runs
``flwr run <app> --stream --federation-config "num-supernodes=10 client-resources-num-cpus=1 ..."``
(on a copy of the app's FAB files, ``fedfm_flower.simulation.app_stage``) with the project's
environment (see ``scripts/env.sh``), then stops the detached local SuperLink that ``flwr run``
started (by process id; Flower leaves it running otherwise), also when the launcher itself is
stopped with SIGTERM or Ctrl-C. With CUDA, each ClientApp gets a fraction of
the GPU (``--gpu-fraction``) so several clients share it; without, the ClientApps run in
workers forked from a fork server started here before ``flwr run``
(``fedfm_flower.simulation.fork_engine``).

Before anything starts, the run config (the app's defaults plus the ``-c``/``--run-config``
overrides) is validated and checked (``fedfm_flower.simulation.preflight``); a problem is one line
on stderr and exit status 2, as is a missing ``flwr`` (looked for beside this interpreter, then
on PATH: ``fedfm_flower.simulation.processes.flower_command``). The run's stream is shown with
tracebacks folded into their last line (``--debug`` shows them) and is saved whole to
``<output-dir>/logs/``. The exit status is Flower's verdict on the run
(``fedfm_flower.simulation.verdict.ExitCode``): 0 only when it completed.

Imports inside functions keep ``torch`` out of this module's start-up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import IO, TYPE_CHECKING

from fedfm_flower.records.tracebacks import StreamFilter
from fedfm_flower.simulation.app_stage import stage_app
from fedfm_flower.simulation.fork_engine import SERVER_VAR, chosen_engine, launch_server
from fedfm_flower.simulation.preflight import check_run, parse_overrides, resolve_config
from fedfm_flower.simulation.processes import (
    FlowerCommandNotFound,
    exit_on_sigterm,
    flower_command,
    flower_environment,
    proc_cmdline,
    stop_processes,
    stop_tagged,
)
from fedfm_flower.simulation.verdict import (
    ExitCode,
    exit_code_for_status,
    final_run_status,
    run_id_from_lines,
)

if TYPE_CHECKING:
    from fedfm_flower.simulation.preflight import Preflight

ROOT = Path(__file__).resolve().parents[2]  # the repository: the Flower App
LAUNCH_TAG = "FEDFM_SIMULATION_ID"  # environment tag of every process of one launch


def local_superlinks() -> dict[int, Path]:
    """Every running local SuperLink that ``flwr run`` started, by pid, with its log file (under
    ``<FLWR_HOME>/local-superlink/``, which names the FLWR_HOME it belongs to)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        cmdline = proc_cmdline(int(entry.name))
        if not any("flower-superlink" in part for part in cmdline[:2]):
            continue
        logs = [cmdline[i + 1] for i, part in enumerate(cmdline[:-1]) if part == "--log-file"]
        if logs and Path(logs[0]).parent.name == "local-superlink":
            found[int(entry.name)] = Path(logs[0])
    return found


def local_superlink_pids(flwr_home: Path) -> list[int]:
    """Process ids of local SuperLinks whose logs live under ``flwr_home``."""
    home = flwr_home / "local-superlink"
    return sorted(pid for pid, log in local_superlinks().items() if log.parent == home)


def foreign_local_superlinks(flwr_home: Path) -> dict[int, Path]:
    """Local SuperLinks of another FLWR_HOME, by pid, with their log file.

    Flower's local SuperLink listens on one fixed address (127.0.0.1:39091 by default): while one
    of another FLWR_HOME runs, ``flwr run`` would send this app into it, with that SuperLink's
    environment and runtime, instead of starting ours.
    """
    home = flwr_home / "local-superlink"
    return {pid: log for pid, log in local_superlinks().items() if log.parent != home}


def cuda_available() -> bool:
    """Whether torch sees a CUDA device; torch (~400 MB, seconds) is imported only if a driver is.

    This launcher only waits for `flwr run`, so on a machine without an NVIDIA driver it does
    not pay for importing torch at all.
    """
    if not (Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi")):
        return False
    import torch

    return torch.cuda.is_available()


def federation_config(num_supernodes: int, gpu_fraction: float, client_cpus: int = 1) -> str:
    """The --federation-config string for the local Ray simulation."""
    parts = [
        f"num-supernodes={num_supernodes}",
        f"client-resources-num-cpus={client_cpus}",
        f"client-resources-num-gpus={gpu_fraction}",
    ]
    return " ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.simulation", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--num-supernodes", type=int, default=10)
    parser.add_argument(
        "--gpu-fraction",
        type=float,
        default=None,
        help="GPU share per ClientApp (default: 0.25 with CUDA, else 0)",
    )
    parser.add_argument(
        "--client-cpus",
        type=int,
        default=1,
        help="CPUs per ClientApp (Ray runs usable CPUs / this many clients at once)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="stop the run after this many seconds"
    )
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks (of the checks and of the run)"
    )
    parser.add_argument("--app", default=str(ROOT))
    parser.add_argument("flwr_args", nargs="*", help="extra arguments for `flwr run`")
    return parser


def run_config_items(flwr_args: list[str]) -> list[str]:
    """The values of every ``-c``/``--run-config`` among the `flwr run` arguments."""
    finder = argparse.ArgumentParser(add_help=False)
    finder.add_argument("-c", "--run-config", action="append", default=[])
    known, _ = finder.parse_known_args(flwr_args)
    return known.run_config


def main(argv: list[str] | None = None) -> int:
    """Check the run, run `flwr run`, stop the local SuperLink; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, value in (
        ("--num-supernodes", args.num_supernodes),
        ("--client-cpus", args.client_cpus),
    ):
        if value <= 0:
            parser.error(f"{flag} must be > 0, got {value}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    try:
        chosen_engine(os.environ)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    app = Path(args.app).resolve()
    try:
        flwr = flower_command("flwr")
    except FlowerCommandNotFound as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    try:
        checked = preflight(app, args.flwr_args, args.num_supernodes)
    except Exception as err:  # noqa: BLE001 - every failure here is the user's one line
        if args.debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    for note in checked.notes:
        print(f"[check] {note}", flush=True)
    gpu_fraction = args.gpu_fraction
    if gpu_fraction is None:
        gpu_fraction = 0.25 if cuda_available() else 0.0
    flwr_home = Path(os.environ.get("FLWR_HOME", ROOT / ".flwr"))
    env = flower_environment(flwr_home)
    launch = {LAUNCH_TAG: uuid.uuid4().hex}  # inherited by all that flwr run starts, Ray too
    env.update(launch)
    stop_processes(local_superlink_pids(flwr_home))  # a stale one would run an old app
    foreign = foreign_local_superlinks(flwr_home)
    if foreign:
        pid, log = next(iter(foreign.items()))
        print(
            f"error: a local SuperLink of another FLWR_HOME ({log.parent.parent}) is running "
            f"(pid {pid}); `flwr run` would send this run into it. Stop it (`kill {pid}`) or "
            f"run with FLWR_HOME={log.parent.parent}",
            file=sys.stderr,
            flush=True,
        )
        return ExitCode.NOT_STARTED
    # flwr run builds the FAB from a copy of its files: the same FAB, without walking .venv
    try:
        stage = stage_app(app, flwr_home / "staged-apps" / launch[LAUNCH_TAG])
    except Exception as err:  # noqa: BLE001 - Flower's FAB rules refuse the app: one line
        if args.debug:
            traceback.print_exc()
        print(f"error: the app's FAB cannot be built: {err}", file=sys.stderr, flush=True)
        return ExitCode.BAD_INPUT
    # The workers' libraries import while Flower starts (fedfm_flower.simulation.fork_engine).
    fork_server = launch_server(env, args.client_cpus, gpu_fraction)
    if fork_server is not None:
        env[SERVER_VAR] = fork_server.variable()
    command = [
        flwr,
        "run",
        str(stage),
        "--stream",
        "--federation-config",
        federation_config(args.num_supernodes, gpu_fraction, args.client_cpus),
        *args.flwr_args,
    ]
    log_path = launch_log_path(Path(checked.config.output_dir), launch[LAUNCH_TAG])
    print("+ " + " ".join(command), flush=True)
    print(f"[log] {log_path}", flush=True)
    exit_on_sigterm()  # a SIGTERM (timeout, scheduler) still stops what flwr run started
    with open(log_path, "w") as log_file:
        shown = StreamFilter(lambda text: print(text, flush=True), debug=args.debug)
        process = subprocess.Popen(
            command,
            env=env,
            cwd=app,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        lines: list[str] = []
        reader = threading.Thread(
            target=_copy_stream, args=(process.stdout, log_file, shown, lines), daemon=True
        )
        reader.start()
        try:
            code = _wait(process, args.timeout, flwr, env, app, lines)
            reader.join(timeout=10)
            run_id = run_id_from_lines(lines)
            if code is not None:
                return code
            if run_id is None:
                print(
                    f"error: `flwr run` exited with {process.returncode} before a run started; "
                    f"see {log_path}",
                    file=sys.stderr,
                    flush=True,
                )
                return ExitCode.NOT_STARTED
            status, details = final_run_status(flwr, "local", run_id, env, cwd=str(app))
            code = exit_code_for_status(status)
            if code != ExitCode.COMPLETED:
                print(
                    f"error: run {run_id} {status}: {details or 'no details'}; log {log_path}",
                    file=sys.stderr,
                    flush=True,
                )
            return code
        except KeyboardInterrupt:
            print("\ninterrupted; stopping the run", file=sys.stderr, flush=True)
            return ExitCode.INTERRUPTED
        finally:
            if process.poll() is None:  # we were stopped: stop `flwr run` too
                process.terminate()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            stop_processes(local_superlink_pids(flwr_home))
            if fork_server is not None:
                fork_server.stop()
            # Stopped mid-run, Ray's agents outlive their raylet: stop whatever is left of ours.
            stop_tagged(launch, grace_s=5.0)
            reader.join(timeout=5)
            shutil.rmtree(stage, ignore_errors=True)


def preflight(app: Path, flwr_args: list[str], num_supernodes: int) -> Preflight:
    """Validate the merged run config and check the run (``fedfm_flower.simulation.preflight``;
    imported
    here, since it loads torch and the data stack, which `--help` does not need)."""

    overrides = parse_overrides(run_config_items(flwr_args), app)
    return check_run(resolve_config(app, overrides), num_supernodes)


def launch_log_path(output_dir: Path, launch_id: str) -> Path:
    """``<output-dir>/logs/simulation-<UTC time>-<launch id>.log`` (the directory is created)."""
    logs = output_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return logs / f"simulation-{stamp}-{launch_id[:8]}.log"


def _copy_stream(stream: IO[str], log_file: IO[str], shown: StreamFilter, lines: list[str]) -> None:
    for line in stream:
        log_file.write(line)
        log_file.flush()
        lines.append(line)
        shown.feed(line)
    shown.close()


def _wait(
    process: subprocess.Popen,
    timeout: float | None,
    flwr: str,
    env: dict[str, str],
    app: Path,
    lines: list[str],
) -> ExitCode | None:
    """Wait for `flwr run`; after ``timeout`` stop the run and return TIMEOUT (else None)."""
    try:
        process.wait(timeout=timeout)
        return None
    except subprocess.TimeoutExpired:
        pass
    run_id = run_id_from_lines(lines)
    print(
        f"error: the run did not finish within --timeout {timeout:g} s; stopping it",
        file=sys.stderr,
        flush=True,
    )
    if run_id is not None:
        subprocess.run(
            [flwr, "stop", str(run_id), "local"],
            env=env,
            cwd=app,
            capture_output=True,
            timeout=60,
            check=False,
        )
    return ExitCode.TIMEOUT
