"""How many rows of D one learner call takes: a budget of activation elements per device.

A learner call on r rows of a window of L steps keeps about r * L * e activation elements for
its backward pass (``SequenceLearner.elements_per_row_step``: e). ``PFedSeqServer.chunk_rows``
divides the device's budget by L * e; ``pfedseq-chunk-size`` > 0 overrides it.

* **CUDA**: ``CUDA_FREE_FRACTION`` of the device's free memory (``torch.cuda.mem_get_info``)
  in float32 elements. The peak of a call was measured at 1.0-1.3x its kept activations
  (265-344 MiB for a 2**26-element chunk on an H200), so a fraction of 0.4 leaves room for the
  gradients, temporaries and whatever else the process holds; on a large card one call then
  covers every row of every layer (one learner call per pass), which is what removes the
  per-chunk launches that bound the step there.
* **CPU**: ``CPU_ELEMENTS`` (2**26, 256 MiB of activations), capped at ``CPU_RAM_FRACTION`` of
  the memory the kernel reports available (``/proc/meminfo``), so a machine short of memory
  takes smaller chunks instead of swapping. Cache-sized chunks were measured slower with the
  fused scan (2 cores, N = 10, L = 5, 4 layers: D = 4,096 in one call 0.133 s, in 1,024-row
  chunks 0.180 s; D = 16,384 in 2 calls 0.472 s, in 1,024-row chunks 0.641 s): every call
  pays the learner's Python dispatch, and the fused loop keeps its state in registers anyway.
"""

from __future__ import annotations

from pathlib import Path

import torch

FLOAT_BYTES = 4
CUDA_FREE_FRACTION = 0.4
CPU_ELEMENTS = 1 << 26
CPU_RAM_FRACTION = 0.25
MEMINFO = Path("/proc/meminfo")


def budget_elements(device: torch.device, free_bytes: int | None = None) -> int:
    """Activation elements one learner call may keep on ``device``; ``free_bytes`` (tests,
    benchmarks): the free memory to size by instead of the device's own reading."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] if free_bytes is None else free_bytes
        return max(1, int(free * CUDA_FREE_FRACTION) // FLOAT_BYTES)
    available = available_ram_bytes() if free_bytes is None else free_bytes
    if available is None:
        return CPU_ELEMENTS
    return max(1, min(CPU_ELEMENTS, int(available * CPU_RAM_FRACTION) // FLOAT_BYTES))


def available_ram_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is no such file)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
