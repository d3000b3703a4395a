"""Run the Flower App in local simulation with `flwr run`, and clean up what that started.

``python -m fedfm_flower.simulation --num-supernodes 10 -- [flwr run args]`` runs
``flwr run . --stream --federation-config "num-supernodes=10 client-resources-num-cpus=1 ..."``
with the project's environment (see ``scripts/env.sh``), then stops the detached local SuperLink
that ``flwr run`` started (by process id; Flower leaves it running otherwise), also when the
launcher itself is stopped with SIGTERM or Ctrl-C. With CUDA, each
ClientApp gets a fraction of the GPU (``--gpu-fraction``) so several clients share it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from fedfm_flower.processes import (
    exit_on_sigterm,
    flower_environment,
    stop_processes,
    stop_tagged,
)

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TAG = "FEDFM_SIMULATION_ID"  # environment tag of every process of one launch


def local_superlink_pids(flwr_home: Path) -> list[int]:
    """Process ids of local SuperLinks whose logs live under ``flwr_home``."""
    marker = str(flwr_home / "local-superlink")
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any("flower-superlink" in part for part in cmdline[:2]) and any(
            marker in part for part in cmdline
        ):
            pids.append(int(proc.name))
    return pids


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


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run `flwr run`, stop the local SuperLink; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--app", default=str(ROOT))
    parser.add_argument("flwr_args", nargs="*", help="extra arguments for `flwr run`")
    args = parser.parse_args(argv)
    if args.num_supernodes <= 0:
        parser.error(f"--num-supernodes must be > 0, got {args.num_supernodes}")
    if args.client_cpus <= 0:
        parser.error(f"--client-cpus must be > 0, got {args.client_cpus}")
    gpu_fraction = args.gpu_fraction
    if gpu_fraction is None:
        gpu_fraction = 0.25 if cuda_available() else 0.0
    flwr_home = Path(os.environ.get("FLWR_HOME", ROOT / ".flwr"))
    env = flower_environment(flwr_home)
    launch = {LAUNCH_TAG: uuid.uuid4().hex}  # inherited by all that flwr run starts, Ray too
    env.update(launch)
    stop_processes(local_superlink_pids(flwr_home))  # a stale one would run an old app
    flwr = str(Path(sys.executable).parent / "flwr")
    command = [
        flwr,
        "run",
        args.app,
        "--stream",
        "--federation-config",
        federation_config(args.num_supernodes, gpu_fraction, args.client_cpus),
        *args.flwr_args,
    ]
    print("+ " + " ".join(command), flush=True)
    exit_on_sigterm()  # a SIGTERM (timeout, scheduler) still stops what flwr run started
    process = subprocess.Popen(command, env=env, cwd=args.app)
    try:
        return process.wait()
    finally:
        if process.poll() is None:  # we were stopped: stop `flwr run` too
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        stop_processes(local_superlink_pids(flwr_home))
        # Stopped mid-run, Ray's agents outlive their raylet: stop whatever is left of ours.
        stop_tagged(launch, grace_s=5.0)


if __name__ == "__main__":
    sys.exit(main())
