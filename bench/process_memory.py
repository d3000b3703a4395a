"""Peak memory of a group of processes (a simulation's SuperLink, ServerApp and Ray workers).

Processes are found by an environment variable the benchmark sets on the process it starts;
every descendant inherits it, including the detached ones Flower and Ray start in new sessions.
Memory is the sum of their PSS (proportional set size: shared pages divided among the sharers),
so the torch libraries mapped by ten workers are not counted ten times.

On a machine with an NVIDIA GPU the device's used memory is sampled too (through NVML, the
library ``nvidia-smi`` reads): the peak over the run minus what was in use when sampling began.
The benchmark machine runs nothing else on its GPU, so that difference is the run's own memory,
CUDA contexts included (about 0.5 GiB per process that touches the GPU).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

from fedfm_flower.simulation.processes import pids_with_environment, proc_cmdline

TAG_VAR = "FEDFM_BENCH_ID"


def tagged_pids(tag: str) -> set[int]:
    """Live processes whose environment has ``FEDFM_BENCH_ID=<tag>``."""
    return pids_with_environment({TAG_VAR: tag})


def pss_bytes(pid: int) -> int:
    """PSS of one process from /proc/<pid>/smaps_rollup (0 if it vanished)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def command_name(pid: int) -> str:
    """A short name for a process: its executable or the Python module/script it runs."""
    parts = [p for p in proc_cmdline(pid) if p]
    if not parts:
        return "?"
    if "-m" in parts[:-1]:
        return parts[parts.index("-m") + 1]
    if Path(parts[0]).name.startswith("python"):
        scripts = [p for p in parts[1:] if not p.startswith("-")]
        return Path(scripts[0]).name if scripts else "python"
    return Path(parts[0]).name


class GpuMemory:
    """Used memory of GPU 0 through NVML; ``available`` is False without a GPU or NVML."""

    def __init__(self) -> None:
        self._handle = None
        try:
            import pynvml  # nvidia-ml-py, in the GPU image; absent on CPU machines

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._pynvml = pynvml
        except Exception:  # no library, no driver or no device: no GPU figures
            self._handle = None

    @property
    def available(self) -> bool:
        """Whether GPU memory can be read here."""
        return self._handle is not None

    def used_bytes(self) -> int:
        """Memory in use on the whole device."""
        return int(self._pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)


class PeakMemory:
    """Samples the summed PSS of a group of processes in a thread; keeps the peak. The group is
    the processes tagged ``tag``, or what ``pids`` returns at each sample."""

    def __init__(
        self,
        tag: str = "",
        interval: float = 0.25,
        pids: Callable[[], set[int]] | None = None,
    ) -> None:
        self.pids = pids or (lambda: tagged_pids(tag))
        self.interval = interval
        self.peak_bytes = 0
        self.peak_processes = 0
        self.by_command: dict[str, int] = {}  # command name -> its largest single-process PSS
        self._gpu = GpuMemory()
        self._gpu_baseline = self._gpu.used_bytes() if self._gpu.available else 0
        self.peak_gpu_bytes: int | None = 0 if self._gpu.available else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        """One look at every process of the group (and the GPU)."""
        pids = self.pids()
        sizes = {pid: pss_bytes(pid) for pid in pids}
        self.peak_bytes = max(self.peak_bytes, sum(sizes.values()))
        self.peak_processes = max(self.peak_processes, len(pids))
        for pid, size in sizes.items():
            self.observe(pid, size)
        if self.peak_gpu_bytes is not None:
            used = self._gpu.used_bytes() - self._gpu_baseline
            self.peak_gpu_bytes = max(self.peak_gpu_bytes, used)

    def observe(self, pid: int, size: int) -> None:
        """What a sample keeps of one process beside the sum: its command's largest PSS."""
        name = command_name(pid)
        self.by_command[name] = max(self.by_command.get(name, 0), size)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)
