"""The selective scan fused into one C loop per row: pFedSeq's fast CPU path.

The eager scan (``selective_scan._grouped_scan``) makes a pass over the (rows, g, d / g, n)
state per operation and step, forward and backward: memory traffic, not arithmetic, bounds it
on a CPU (about 80% of a server step on the offline setups' shape). Here

    h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t,    y_t = <C_t, h_t>    (h_0 = 0)

runs as one C loop per (row, group, channel) that keeps h (n values) in registers over the
whole window. The backward pass recomputes the states and decays from the inputs (they are
never stored), walks the window backwards with dh_t = C_t dy_t + exp(delta_{t+1} A) dh_{t+1}
and returns du, d delta, dB and dC per row and dA summed over rows (each thread's rows into a
buffer of its own, summed after). Rows are split over ``torch.get_num_threads()`` threads
(ctypes releases the GIL); float32 and float64 are compiled. D, z and the softplus of delta
stay in PyTorch around it (``selective_scan``): element-wise, one pass each.

Built at first use with the system C compiler (``cc``) into a cache directory keyed by the
source, flags, compiler and CPU, written atomically so concurrent processes share one build
(about 0.5 s): ``-O3 -march=native`` with glibc's vectorised ``exp`` (libmvec, offered by its
headers under ``-ffast-math`` at compile time only: the link step does not get the flag, so no
``crtfastmath`` changes the process's floating-point mode), else a portable build with scalar
``exp``; ``library()`` is None when neither builds, and ``auto`` then runs the eager loop.
Results equal the eager loop's within float32 rounding (the sums run in another order):
``tests/test_pfedseq.py`` checks values and every gradient against it, in float64 to 1e-12.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fedfm_flower.durable import atomic_path

log = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_STATE 256

/* u, delta (rows, groups, channels, steps); A (groups, channels, n);
   B, C (rows, groups, steps, n); y (rows, groups, channels, steps or 1). */
#define KERNELS(T, SUFFIX, EXP, NCONST)                                                     \
void scan_forward_##SUFFIX(int64_t rows, int64_t groups, int64_t channels, int64_t n_,     \
                           int64_t steps, int64_t last_only, const T* u, const T* delta,    \
                           const T* A, const T* B, const T* C, T* y) {                      \
    const int64_t n = NCONST > 0 ? NCONST : n_; /* a constant lets h live in registers */   \
    int64_t out_steps = last_only ? 1 : steps;                                              \
    for (int64_t r = 0; r < rows; ++r)                                                      \
    for (int64_t g = 0; g < groups; ++g) {                                                  \
        const T* Bg = B + (r * groups + g) * steps * n;                                     \
        const T* Cg = C + (r * groups + g) * steps * n;                                     \
        for (int64_t c = 0; c < channels; ++c) {                                            \
            int64_t row = (r * groups + g) * channels + c;                                  \
            const T* ur = u + row * steps; const T* dr = delta + row * steps;               \
            const T* Ar = A + (g * channels + c) * n;                                       \
            T* yr = y + row * out_steps;                                                    \
            T h[MAX_STATE];                                                                 \
            memset(h, 0, sizeof(T) * n);                                                    \
            for (int64_t t = 0; t < steps; ++t) {                                           \
                const T* bt = Bg + t * n; const T* ct = Cg + t * n;                         \
                T dt = dr[t], st = dt * ur[t], acc = 0;                                     \
                _Pragma("omp simd reduction(+:acc)")                                        \
                for (int64_t k = 0; k < n; ++k) {                                           \
                    h[k] = EXP(dt * Ar[k]) * h[k] + st * bt[k];                             \
                    acc += ct[k] * h[k];                                                    \
                }                                                                           \
                if (!last_only) yr[t] = acc; else if (t == steps - 1) yr[0] = acc;          \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
                                                                                            \
/* dA is this call's own (groups, channels, n) buffer: its rows' sum, added to. */          \
void scan_backward_##SUFFIX(int64_t rows, int64_t groups, int64_t channels, int64_t n_,    \
                            int64_t steps, int64_t last_only, const T* u, const T* delta,   \
                            const T* A, const T* B, const T* C, const T* dy, T* du,         \
                            T* ddelta, T* dA, T* dB, T* dC, T* work) {                      \
    const int64_t n = NCONST > 0 ? NCONST : n_;                                             \
    int64_t out_steps = last_only ? 1 : steps;                                              \
    T* states = work; T* decays = work + steps * n;                                         \
    for (int64_t r = 0; r < rows; ++r)                                                      \
    for (int64_t g = 0; g < groups; ++g) {                                                  \
        const T* Bg = B + (r * groups + g) * steps * n;                                     \
        const T* Cg = C + (r * groups + g) * steps * n;                                     \
        T* dBg = dB + (r * groups + g) * steps * n;                                         \
        T* dCg = dC + (r * groups + g) * steps * n;                                         \
        memset(dBg, 0, sizeof(T) * steps * n);                                              \
        memset(dCg, 0, sizeof(T) * steps * n);                                              \
        for (int64_t c = 0; c < channels; ++c) {                                            \
            int64_t row = (r * groups + g) * channels + c;                                  \
            const T* ur = u + row * steps; const T* dr = delta + row * steps;               \
            const T* Ar = A + (g * channels + c) * n;                                       \
            T* dAr = dA + (g * channels + c) * n;                                           \
            const T* dyr = dy + row * out_steps;                                            \
            T* dur = du + row * steps; T* ddr = ddelta + row * steps;                       \
            for (int64_t t = 0; t < steps; ++t) { /* states and decays, recomputed */       \
                const T* bt = Bg + t * n; T* ht = states + t * n; T* at = decays + t * n;   \
                const T* hp = t ? states + (t - 1) * n : 0;                                 \
                T dt = dr[t], st = dt * ur[t];                                              \
                _Pragma("omp simd")                                                         \
                for (int64_t k = 0; k < n; ++k) {                                           \
                    at[k] = EXP(dt * Ar[k]);                                                \
                    ht[k] = (t ? at[k] * hp[k] : 0) + st * bt[k];                           \
                }                                                                           \
            }                                                                               \
            T dh[MAX_STATE];                                                                \
            memset(dh, 0, sizeof(T) * n);                                                   \
            for (int64_t t = steps - 1; t >= 0; --t) {                                      \
                T dyt = last_only ? (t == steps - 1 ? dyr[0] : 0) : dyr[t];                 \
                const T* bt = Bg + t * n; const T* ct = Cg + t * n;                         \
                const T* ht = states + t * n; const T* at = decays + t * n;                 \
                const T* hp = t ? states + (t - 1) * n : 0;                                 \
                T* dbt = dBg + t * n; T* dct = dCg + t * n;                                 \
                T dt = dr[t], ut = ur[t], st = dt * ut, ds = 0, dda = 0;                    \
                _Pragma("omp simd reduction(+:ds, dda)")                                    \
                for (int64_t k = 0; k < n; ++k) {                                           \
                    dct[k] += dyt * ht[k];                                                  \
                    T d = dh[k] + dyt * ct[k];                                              \
                    T grow = t ? d * hp[k] * at[k] : 0; /* d h_t / d (delta A) */            \
                    dda += grow * Ar[k];                                                    \
                    dAr[k] += grow * dt;                                                    \
                    ds += d * bt[k];                                                        \
                    dbt[k] += d * st;                                                       \
                    dh[k] = d * at[k];                                                      \
                }                                                                           \
                dur[t] = ds * dt;                                                           \
                ddr[t] = ds * ut + dda;                                                     \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}

KERNELS(float, f32, expf, 0)
KERNELS(double, f64, exp, 0)
KERNELS(float, f32_n16, expf, 16)
KERNELS(double, f64_n16, exp, 16)
"""
# (compile flags, link flags), tried in order: vectorised exp (glibc's libmvec, which its
# headers offer under -ffast-math; the link step does not get -ffast-math, so no crtfastmath
# changes the process's floating-point mode), then a portable build with scalar exp.
BUILDS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (
        ("-O3", "-fPIC", "-std=c11", "-fopenmp-simd", "-march=native", "-ffast-math"),
        ("-lmvec", "-lm"),
    ),
    (("-O3", "-fPIC", "-std=c11", "-fopenmp-simd"), ("-lm",)),
)
MAX_STATE = 256  # the C arrays' size: the state dimension n may not exceed it
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def cache_directory() -> Path:
    """Where built kernels are kept: ``kernels`` under the default cache directory
    (``$XDG_CACHE_HOME/fedfm-flower``)."""
    from fedfm_flower.config import default_cache_path

    return default_cache_path() / "kernels"


def _cpu_flags() -> str:
    """This CPU's feature flags (-march=native builds are only valid on such a CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


class _BuildFailed(RuntimeError):
    """The compiler refused one flag set (the next one is tried)."""


def _build(compiler: str, version: str, compile_flags: tuple, link_flags: tuple) -> Path:
    """The shared library for one flag set, built once into the cache (atomically)."""
    identity = "\n".join([SOURCE, *compile_flags, *link_flags, version, _cpu_flags()])
    target = (
        cache_directory() / f"fused_scan_{hashlib.sha256(identity.encode()).hexdigest()[:16]}.so"
    )
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # atomic: a concurrent build lands the same file; a failed one leaves nothing
    with (
        tempfile.TemporaryDirectory(dir=target.parent) as scratch,
        atomic_path(target, durable=False) as built,
    ):
        source, obj = Path(scratch) / "s.c", Path(scratch) / "s.o"
        source.write_text(SOURCE)
        for command in (
            [compiler, *compile_flags, "-c", str(source), "-o", str(obj)],
            [compiler, "-shared", str(obj), "-o", str(built), *link_flags],
        ):
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise _BuildFailed(f"{compile_flags}: {result.stderr[-500:]}")
    return target


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None when no C compiler works here."""
    compiler = os.environ.get("CC", "cc")
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        log.info("no C compiler (%s): the selective scan runs its eager loop", compiler)
        return None
    for compile_flags, link_flags in BUILDS:
        try:
            target = _build(compiler, version, compile_flags, link_flags)
        except _BuildFailed as error:
            log.info("fused scan build failed: %s", error)
            continue
        except (OSError, subprocess.SubprocessError) as error:  # cache not writable, timeout
            log.warning("the fused scan cannot be built (%s); the eager loop runs", error)
            return None
        try:
            return ctypes.CDLL(str(target))
        except OSError as error:
            log.info("fused scan %s does not load: %s", target, error)
    log.warning("the fused scan could not be built; the selective scan runs its eager loop")
    return None


def available() -> bool:
    """Whether the fused kernels can run here."""
    return library() is not None


def _variant(dtype: torch.dtype, n: int) -> str:
    """The kernels' name suffix: a build for n = 16 (Mamba's default state) or any n."""
    return f"{_SUFFIX[dtype]}_n16" if n == 16 else _SUFFIX[dtype]


def _pointer(tensor: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())


def _sizes(*values: int) -> list[ctypes.c_int64]:
    return [ctypes.c_int64(v) for v in values]


def _split(rows: int) -> list[tuple[int, int]]:
    """Row ranges, one per torch thread (at least 64 rows each)."""
    parts = max(1, min(torch.get_num_threads(), rows // 64))
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1))


# a forked child has none of its parent's pool threads: it makes its own
os.register_at_fork(after_in_child=_pool.cache_clear)


def _run(ranges: list[tuple[int, int]], call: Callable[[int, int, int], None]) -> None:
    """``call(lo, hi, part)`` for each row range, on the pool's threads when more than one."""
    if len(ranges) == 1:
        call(*ranges[0], 0)
        return
    futures = [_pool().submit(call, lo, hi, part) for part, (lo, hi) in enumerate(ranges)]
    for future in futures:
        future.result()


class FusedScan(torch.autograd.Function):
    """y_t = <C_t, h_t>, h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t, per row and channel."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, last_only):  # noqa: ANN001, ANN205 - autograd's
        """u, delta (rows, g, c, L); A (g, c, n); B, C (rows, g, L, n) -> (rows, g, c, L or 1)."""
        u, delta, A, B, C = (t.contiguous() for t in (u, delta, A, B, C))
        rows, groups, channels, steps = u.shape
        n = A.shape[-1]
        y = u.new_empty(rows, groups, channels, 1 if last_only else steps)
        kernel = getattr(library(), f"scan_forward_{_variant(u.dtype, n)}")

        def call(lo: int, hi: int, part: int) -> None:
            pointers = [_pointer(t[lo:]) for t in (u, delta)] + [_pointer(A)]
            pointers += [_pointer(t[lo:]) for t in (B, C, y)]
            kernel(*_sizes(hi - lo, groups, channels, n, steps, int(last_only)), *pointers)

        _run(_split(rows), call)
        ctx.save_for_backward(u, delta, A, B, C)
        ctx.last_only = last_only
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205 - autograd's signature
        """Gradients of u, delta, A, B and C (none of ``last_only``)."""
        u, delta, A, B, C = ctx.saved_tensors
        dy = dy.contiguous()
        rows, groups, channels, steps = u.shape
        n = A.shape[-1]
        du, ddelta, dB, dC = (torch.empty_like(t) for t in (u, delta, B, C))
        ranges = _split(rows)
        dA_parts = A.new_zeros(len(ranges), *A.shape)  # each range sums its own rows
        kernel = getattr(library(), f"scan_backward_{_variant(u.dtype, n)}")

        def call(lo: int, hi: int, part: int) -> None:
            work = u.new_empty(2 * steps * n)
            pointers = [_pointer(t[lo:]) for t in (u, delta)] + [_pointer(A)]
            pointers += [_pointer(t[lo:]) for t in (B, C, dy, du, ddelta)]
            pointers += [_pointer(dA_parts[part])]
            pointers += [_pointer(t[lo:]) for t in (dB, dC)] + [_pointer(work)]
            kernel(*_sizes(hi - lo, groups, channels, n, steps, int(ctx.last_only)), *pointers)

        _run(ranges, call)
        return du, ddelta, dA_parts.sum(0), dB, dC, None


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels can take these tensors (CPU, one dtype: float32 or 64)."""
    return (
        all(t.device.type == "cpu" and t.dtype in _SUFFIX for t in tensors)
        and len({t.dtype for t in tensors}) == 1
        and available()
    )


def fused_grouped_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    decay: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    last_only: bool = False,
) -> torch.Tensor:
    """sum_n C_t h_t for u, delta (rows, g, d / g, L), decay = A (g, d / g, n), B and C
    (rows, g, n, L): (rows, g, d / g, L or 1), through ``FusedScan``."""
    if decay.shape[-1] > MAX_STATE:
        raise ValueError(f"the fused scan takes states of <= {MAX_STATE}, got {decay.shape[-1]}")
    return FusedScan.apply(u, delta, decay, B.transpose(-1, -2), C.transpose(-1, -2), last_only)
