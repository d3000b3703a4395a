"""A LoRA adapter of a 7B model's size through a secure loopback deployment, both ways.

    python -m bench.large_messages [--supernodes 1] [--rank 64] [--out results.json]

Starts a SuperLink and ``--supernodes`` SuperNodes (TLS, authentication, warm executors:
``fedfm_flower.deploy``) and runs the probe app ``bench/large_message_app``: its ServerApp sends
each node r = ``--rank`` LoRA A and B of q and v in 32 layers of width 4,096 (134 MB in float32
at r = 64) through fedfm-flower's records, each ClientApp checks it against the spec, adds 1 and
sends it back, and the ServerApp checks the echo exactly. Flower moves each array in 5 MiB
chunks. Reported: the round trip's time, the encode/decode times on both sides, and the peak
resident memory (``VmHWM``) of every process of the deployment, read while they run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

APP_DIR = Path(__file__).resolve().parent / "large_message_app"


def peak_memory_mb(pid: int) -> tuple[str, float] | None:
    """(command, peak resident MB) of a live process, from /proc; None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return command.strip(), int(line.split()[1]) / 1024
    return None


def role(command: str) -> str:
    """Which part of the deployment a command line is."""
    if "fedfm_flower.deploy.superlink" in command:  # flower-superlink through our launcher
        return "flower-superlink"
    for name in ("flower-superlink", "superexec", "supernode", "flwr-clientapp", "flwr run"):
        if name.replace("-", "") in command.replace("-", "").replace("_", ""):
            return name
    return command.split(" ")[0].rsplit("/", 1)[-1]


def measure(workdir: Path, supernodes: int = 1, rank: int = 64, echo: bool = False) -> dict:
    """Run the probe once; its figures plus each deployment process's peak memory."""
    from fedfm_flower.deploy import DeployOptions, LocalDeployment

    options = DeployOptions(
        num_supernodes=supernodes,
        workdir=workdir / "work",
        app_dir=APP_DIR,
        startup_timeout=120.0,
        run_timeout=900.0,
        echo=echo,
        warm_executor=True,
    )
    output = workdir / "runs"
    deployment = LocalDeployment(options)
    processes: list[dict[str, Any]] = []
    try:
        deployment.start()
        started = time.monotonic()
        result = deployment.run(
            {"lora-rank": rank, "output-dir": str(output), "run-name": "large-messages"}
        )
        run_seconds = time.monotonic() - started
        for pid in sorted(deployment.live_pids()):
            found = peak_memory_mb(pid)
            if found is not None:
                processes.append({"pid": pid, "role": role(found[0]), "peak-rss-mb": found[1]})
    finally:
        deployment.stop()
    if not result.ok:
        log = result.log_path.read_text()[-3000:]
        raise RuntimeError(f"the probe run ended {result.status}:\n{log}")
    figures = json.loads((output / "large-messages" / "large_messages.json").read_text())
    return {**figures, "flwr-run-seconds": run_seconds, "processes": processes}


def table(result: dict) -> str:
    """The figures as a Markdown table."""
    mb = result["adapter-bytes"] / 1e6
    rows = [
        ("adapter", f"{mb:.1f} MB, {result['tensors']} tensors (r = {result['lora-rank']})"),
        ("nodes", str(result["nodes"])),
        ("server encode", f"{result['encode-seconds']:.2f} s"),
        (
            "round trip (send, client decode + encode, receive)",
            f"{result['round-trip-seconds']:.2f} s",
        ),
        ("server decode + exact check", f"{result['decode-and-check-seconds']:.2f} s"),
        ("whole `flwr run`", f"{result['flwr-run-seconds']:.1f} s"),
        ("ServerApp peak RSS", f"{result['serverapp-peak-rss-mb']:.0f} MB"),
    ]
    for i, client in enumerate(result["clients"]):
        rows.append(
            (
                f"ClientApp {i}: decode / encode / peak RSS",
                f"{client['decode-seconds']:.2f} s / {client['encode-seconds']:.2f} s / "
                f"{client['peak-rss-mb']:.0f} MB",
            )
        )
    for process in result["processes"]:
        rows.append(
            (
                f"{process['role']} (pid {process['pid']}) peak RSS",
                f"{process['peak-rss-mb']:.0f} MB",
            )
        )
    lines = ["| | |", "|---|---:|"] + [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the probe; print the table; write the figures to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--supernodes", type=int, default=1)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--workdir", type=Path, default=Path("bench/work/large-messages"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from fedfm_flower.simulation.processes import exit_on_sigterm

    exit_on_sigterm()  # a killed bench stops its deployment (finally) instead of leaving it
    if args.supernodes < 1 or args.rank < 1:
        parser.error("--supernodes and --rank must be >= 1")
    result = measure(args.workdir, args.supernodes, args.rank, echo=True)
    result["machine"] = {"platform": platform.platform(), "python": sys.version.split()[0]}
    print(table(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
