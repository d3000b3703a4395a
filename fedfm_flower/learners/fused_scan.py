"""The selective scan fused into one C loop per row, and the mixer's conv + SiLU: pFedSeq's
fast CPU path.

The eager scan (``selective_scan._grouped_scan``) makes a pass over the (rows, g, d / g, n)
state per operation and step, forward and backward: memory traffic, not arithmetic, bounds it
on a CPU (about 80% of a server step on the offline setups' shape). Here

    h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t,    y_t = <C_t, h_t>    (h_0 = 0)

runs as one C loop per (row, group, channel) that keeps h (n values) in registers over the
whole window. The backward pass recomputes the states and decays from the inputs (they are
never stored), walks the window backwards with dh_t = C_t dy_t + exp(delta_{t+1} A) dh_{t+1}
and returns du, d delta, dB and dC per row and dA summed over rows (each thread's rows into a
buffer of its own, summed after). float32 and float64 are compiled.

Threads: the rows are shared by an OpenMP loop over ``torch.get_num_threads()`` threads. The
library is linked with ``-fopenmp`` and loaded after torch, so its ``libgomp.so.1`` is the
one torch already loaded: the kernel runs on torch's own worker threads. A thread pool of our
own ran beside torch's OpenMP workers, which spin after each op: on 2 loaded cores the step
then took 0.8-1.9 s instead of 0.08 s. Like torch's own OpenMP, the kernel must not be called
in a child forked after the parent ran a parallel region (GNU OpenMP hangs there).

Layout: channels last, (groups, rows, steps, channels) for u, delta and y and (groups, rows,
steps, n) for B and C: what the layer-batched learner's matmuls produce
(``stacked.StackedLearners.mamba_channels_last``), so that path makes no copies;
``fused_grouped_scan`` permutes the channels-first layout of ``selective_scan`` to it. With
``softplus`` the kernel takes the raw step size and applies softplus (torch's, threshold 20)
itself, one vectorised pass per row, and returns the raw step size's gradient (times
sigmoid); the ATen softplus on these (rows, channels, L <= 30) tensors cost as much as the
scan's forward. D and the gate stay in PyTorch around it.

The mixer's depthwise causal conv and its SiLU are one kernel too (``fused_conv_silu``,
same layout, the pre-activation recomputed in the backward pass, weight and bias gradients
summed per thread): in eager PyTorch on this layout they were a pad, one multiply-add per tap,
SiLU and their backward, about 15 ms of a 100 ms step (2 cores, D = 4,096, N = 10, L = 10),
4 ms fused.

Built at first use with the system C compiler (``cc``) into a cache directory keyed by the
source, flags, compiler and CPU, written atomically so concurrent processes share one build
(about 0.5 s): ``-O3 -march=native`` with glibc's vectorised ``exp`` and ``log1p`` (libmvec,
offered by its headers under ``-ffast-math`` at compile time only: the link step does not get
the flag, so no ``crtfastmath`` changes the process's floating-point mode), else a portable
build with scalar ones, else one without OpenMP; ``library()`` is None when none builds, and
``auto`` then runs the eager loop.
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
from pathlib import Path

import torch

from fedfm_flower.config.experiment import default_cache_path
from fedfm_flower.learners import triton_scan
from fedfm_flower.records.durable import atomic_path

log = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_STATE 256
#define SOFTPLUS_THRESHOLD 20 /* torch's: softplus(x) = x above it */
#ifdef _OPENMP
#include <omp.h>
#define THREAD() omp_get_thread_num()
#else
#define THREAD() 0
#endif
#define MIN_PARALLEL_ROWS 64

/* Channels last: u, delta (groups, rows, steps, channels); A (groups, channels, n);
   B, C (groups, rows, steps, n); y, dy (groups, rows, steps or 1, channels). Rows are
   shared over `threads` OpenMP threads (torch's own runtime: see the module docstring);
   `work` holds each thread's scratch. With softplus, delta is the raw step size (before
   softplus) and ddelta its gradient. */
#define KERNELS(T, SUFFIX, EXP, LOG1P, NCONST)                                               \
static void step_sizes_##SUFFIX(const T* raw, T* out, int64_t count, int64_t softplus) {    \
    if (!softplus) { memcpy(out, raw, sizeof(T) * count); return; }                         \
    _Pragma("omp simd")                                                                     \
    for (int64_t i = 0; i < count; ++i) {                                                   \
        T x = raw[i];                                                                       \
        out[i] = x > SOFTPLUS_THRESHOLD ? x : LOG1P(EXP(x));                                \
    }                                                                                       \
}                                                                                           \
                                                                                            \
void scan_forward_##SUFFIX(int64_t groups, int64_t rows, int64_t threads, int64_t steps,   \
                           int64_t channels, int64_t n_, int64_t last_only,                 \
                           int64_t softplus, const T* u, const T* delta, const T* A,        \
                           const T* B, const T* C, T* y, T* work) {                         \
    const int64_t n = NCONST > 0 ? NCONST : n_; /* a constant lets h live in registers */   \
    const int64_t out_steps = last_only ? 1 : steps, slab = steps * channels;               \
    _Pragma("omp parallel for num_threads(threads) if(rows >= MIN_PARALLEL_ROWS)")          \
    for (int64_t r = 0; r < rows; ++r)                                                      \
    for (int64_t g = 0; g < groups; ++g) {                                                  \
        T* dts = work + THREAD() * slab;                                                    \
        const int64_t at = g * rows + r;                                                    \
        const T* ur = u + at * slab; const T* Bg = B + at * steps * n;                      \
        const T* Cg = C + at * steps * n; T* yr = y + at * out_steps * channels;            \
        step_sizes_##SUFFIX(delta + at * slab, dts, slab, softplus);                        \
        for (int64_t c = 0; c < channels; ++c) {                                            \
            const T* Ar = A + (g * channels + c) * n;                                       \
            T h[MAX_STATE];                                                                 \
            memset(h, 0, sizeof(T) * n);                                                    \
            for (int64_t t = 0; t < steps; ++t) {                                           \
                const T* bt = Bg + t * n; const T* ct = Cg + t * n;                         \
                T dt = dts[t * channels + c], st = dt * ur[t * channels + c], acc = 0;      \
                _Pragma("omp simd reduction(+:acc)")                                        \
                for (int64_t k = 0; k < n; ++k) {                                           \
                    h[k] = EXP(dt * Ar[k]) * h[k] + st * bt[k];                             \
                    acc += ct[k] * h[k];                                                    \
                }                                                                           \
                if (!last_only) yr[t * channels + c] = acc;                                 \
                else if (t == steps - 1) yr[c] = acc;                                       \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
                                                                                            \
/* dA_parts: a (groups, channels, n) buffer per thread, its rows' sum, added to. */        \
void scan_backward_##SUFFIX(int64_t groups, int64_t rows, int64_t threads, int64_t steps,  \
                            int64_t channels, int64_t n_, int64_t last_only,                \
                            int64_t softplus, const T* u, const T* delta, const T* A,       \
                            const T* B, const T* C, const T* dy, T* du, T* ddelta,          \
                            T* dA_parts, T* dB, T* dC, T* work) {                           \
    const int64_t n = NCONST > 0 ? NCONST : n_;                                             \
    const int64_t out_steps = last_only ? 1 : steps, slab = steps * channels;               \
    _Pragma("omp parallel for num_threads(threads) if(rows >= MIN_PARALLEL_ROWS)")          \
    for (int64_t r = 0; r < rows; ++r)                                                      \
    for (int64_t g = 0; g < groups; ++g) {                                                  \
        T* states = work + THREAD() * (2 * steps * n + slab);                               \
        T* decays = states + steps * n; T* dts = states + 2 * steps * n;                    \
        T* dA = dA_parts + THREAD() * groups * channels * n;                                \
        const int64_t at = g * rows + r;                                                    \
        const T* ur = u + at * slab; const T* raw = delta + at * slab;                      \
        const T* Bg = B + at * steps * n; const T* Cg = C + at * steps * n;                 \
        T* dBg = dB + at * steps * n; T* dCg = dC + at * steps * n;                         \
        const T* dyr = dy + at * out_steps * channels;                                      \
        T* dur = du + at * slab; T* ddr = ddelta + at * slab;                               \
        memset(dBg, 0, sizeof(T) * steps * n);                                              \
        memset(dCg, 0, sizeof(T) * steps * n);                                              \
        step_sizes_##SUFFIX(raw, dts, slab, softplus);                                      \
        for (int64_t c = 0; c < channels; ++c) {                                            \
            const T* Ar = A + (g * channels + c) * n;                                       \
            T* dAr = dA + (g * channels + c) * n;                                           \
            for (int64_t t = 0; t < steps; ++t) { /* states and decays, recomputed */       \
                const T* bt = Bg + t * n; T* ht = states + t * n; T* dc = decays + t * n;   \
                const T* hp = t ? states + (t - 1) * n : 0;                                 \
                T dt = dts[t * channels + c], st = dt * ur[t * channels + c];               \
                _Pragma("omp simd")                                                         \
                for (int64_t k = 0; k < n; ++k) {                                           \
                    dc[k] = EXP(dt * Ar[k]);                                                \
                    ht[k] = (t ? dc[k] * hp[k] : 0) + st * bt[k];                           \
                }                                                                           \
            }                                                                               \
            T dh[MAX_STATE];                                                                \
            memset(dh, 0, sizeof(T) * n);                                                   \
            for (int64_t t = steps - 1; t >= 0; --t) {                                      \
                T dyt = last_only ? (t == steps - 1 ? dyr[c] : 0) : dyr[t * channels + c];  \
                const T* bt = Bg + t * n; const T* ct = Cg + t * n;                         \
                const T* ht = states + t * n; const T* dc = decays + t * n;                 \
                const T* hp = t ? states + (t - 1) * n : 0;                                 \
                T* dbt = dBg + t * n; T* dct = dCg + t * n;                                 \
                T dt = dts[t * channels + c], ut = ur[t * channels + c], st = dt * ut;      \
                T ds = 0, dda = 0;                                                          \
                _Pragma("omp simd reduction(+:ds, dda)")                                    \
                for (int64_t k = 0; k < n; ++k) {                                           \
                    dct[k] += dyt * ht[k];                                                  \
                    T d = dh[k] + dyt * ct[k];                                              \
                    T grow = t ? d * hp[k] * dc[k] : 0; /* d h_t / d (delta A) */            \
                    dda += grow * Ar[k];                                                    \
                    dAr[k] += grow * dt;                                                    \
                    ds += d * bt[k];                                                        \
                    dbt[k] += d * st;                                                       \
                    dh[k] = d * dc[k];                                                      \
                }                                                                           \
                dur[t * channels + c] = ds * dt;                                            \
                ddr[t * channels + c] = ds * ut + dda;                                      \
            }                                                                               \
        }                                                                                   \
        if (softplus) { /* through the softplus: times sigmoid(raw) */                      \
            _Pragma("omp simd")                                                             \
            for (int64_t i = 0; i < slab; ++i) {                                            \
                T e = EXP(raw[i]);                                                          \
                ddr[i] *= raw[i] > SOFTPLUS_THRESHOLD ? (T)1 : e / (1 + e);                 \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}

KERNELS(float, f32, expf, log1pf, 0)
KERNELS(double, f64, exp, log1p, 0)
KERNELS(float, f32_n16, expf, log1pf, 16)
KERNELS(double, f64_n16, exp, log1p, 16)

/* SiLU(depthwise causal conv along the steps), channels last: x, out, dout (groups, rows,
   steps, channels); taps (groups, width, channels), tap j reading step t - (width - 1) + j;
   bias (groups, channels). The backward pass recomputes the pre-activation; dtaps_parts and
   dbias_parts hold one (groups, width, channels) and (groups, channels) sum per thread. */
#define CONV(T, SUFFIX, EXP)                                                                 \
static void conv_pre_##SUFFIX(const T* xs, const T* tg, const T* bg, T* pre,                \
                              int64_t steps, int64_t channels, int64_t width) {             \
    for (int64_t t = 0; t < steps; ++t) {                                                   \
        T* p = pre + t * channels;                                                          \
        _Pragma("omp simd")                                                                 \
        for (int64_t c = 0; c < channels; ++c) p[c] = bg[c];                                \
        for (int64_t j = 0; j < width; ++j) {                                               \
            int64_t s = t - (width - 1) + j;                                                \
            if (s < 0) continue;                                                            \
            const T* xr = xs + s * channels; const T* tj = tg + j * channels;               \
            _Pragma("omp simd")                                                             \
            for (int64_t c = 0; c < channels; ++c) p[c] += tj[c] * xr[c];                   \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
                                                                                            \
void conv_forward_##SUFFIX(int64_t groups, int64_t rows, int64_t threads, int64_t steps,    \
                           int64_t channels, int64_t width, const T* x, const T* taps,      \
                           const T* bias, T* out) {                                         \
    const int64_t slab = steps * channels;                                                  \
    _Pragma("omp parallel for num_threads(threads) if(rows >= MIN_PARALLEL_ROWS)")          \
    for (int64_t r = 0; r < rows; ++r)                                                      \
    for (int64_t g = 0; g < groups; ++g) {                                                  \
        const int64_t at = (g * rows + r) * slab;                                           \
        T* o = out + at;                                                                    \
        conv_pre_##SUFFIX(x + at, taps + g * width * channels, bias + g * channels, o,      \
                          steps, channels, width);                                          \
        _Pragma("omp simd")                                                                 \
        for (int64_t i = 0; i < slab; ++i) o[i] = o[i] / (1 + EXP(-o[i]));                  \
    }                                                                                       \
}                                                                                           \
                                                                                            \
void conv_backward_##SUFFIX(int64_t groups, int64_t rows, int64_t threads, int64_t steps,   \
                            int64_t channels, int64_t width, const T* x, const T* taps,     \
                            const T* bias, const T* dout, T* dx, T* dtaps_parts,            \
                            T* dbias_parts, T* work) {                                      \
    const int64_t slab = steps * channels;                                                  \
    _Pragma("omp parallel for num_threads(threads) if(rows >= MIN_PARALLEL_ROWS)")          \
    for (int64_t r = 0; r < rows; ++r)                                                      \
    for (int64_t g = 0; g < groups; ++g) {                                                  \
        const int64_t at = (g * rows + r) * slab;                                           \
        const T* xs = x + at; const T* tg = taps + g * width * channels;                    \
        const T* ds = dout + at; T* dxs = dx + at;                                          \
        T* dt = dtaps_parts + (THREAD() * groups + g) * width * channels;                   \
        T* db = dbias_parts + (THREAD() * groups + g) * channels;                           \
        T* dpre = work + THREAD() * slab;                                                   \
        conv_pre_##SUFFIX(xs, tg, bias + g * channels, dpre, steps, channels, width);       \
        _Pragma("omp simd")                                                                 \
        for (int64_t i = 0; i < slab; ++i) { /* d silu(p) = sig (1 + p (1 - sig)) */        \
            T p = dpre[i], sig = 1 / (1 + EXP(-p));                                         \
            dpre[i] = ds[i] * sig * (1 + p * (1 - sig));                                    \
            dxs[i] = 0;                                                                     \
        }                                                                                   \
        for (int64_t t = 0; t < steps; ++t) {                                               \
            const T* d = dpre + t * channels;                                               \
            _Pragma("omp simd")                                                             \
            for (int64_t c = 0; c < channels; ++c) db[c] += d[c];                           \
            for (int64_t j = 0; j < width; ++j) {                                           \
                int64_t s = t - (width - 1) + j;                                            \
                if (s < 0) continue;                                                        \
                const T* xr = xs + s * channels; const T* tj = tg + j * channels;           \
                T* dxr = dxs + s * channels; T* dtj = dt + j * channels;                    \
                _Pragma("omp simd")                                                         \
                for (int64_t c = 0; c < channels; ++c) {                                    \
                    dxr[c] += tj[c] * d[c];                                                 \
                    dtj[c] += xr[c] * d[c];                                                 \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}

CONV(float, f32, expf)
CONV(double, f64, exp)
"""
# (compile flags, link flags), tried in order: OpenMP threads and vectorised exp (glibc's
# libmvec, which its headers offer under -ffast-math; the link step does not get -ffast-math,
# so no crtfastmath changes the process's floating-point mode), then a portable build with
# scalar exp, then one without threads.
_NATIVE = ("-march=native", "-ffast-math")
BUILDS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("-O3", "-fPIC", "-std=c11", "-fopenmp", *_NATIVE), ("-fopenmp", "-lmvec", "-lm")),
    (("-O3", "-fPIC", "-std=c11", "-fopenmp"), ("-fopenmp", "-lm")),
    (("-O3", "-fPIC", "-std=c11", "-fopenmp-simd"), ("-lm",)),
)
MAX_STATE = 256  # the C arrays' size: the state dimension n may not exceed it
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def cache_directory() -> Path:
    """Where built kernels are kept: ``kernels`` under the default cache directory
    (``$XDG_CACHE_HOME/fedfm-flower``)."""

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


def _threads(rows: int) -> int:
    """OpenMP threads for a call on ``rows`` rows: torch's intra-op count."""
    return max(1, min(torch.get_num_threads(), rows))


class FusedScan(torch.autograd.Function):
    """y_t = <C_t, h_t>, h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t, per row and channel
    (delta_t = softplus of the given step size when ``softplus``)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, last_only, softplus):  # noqa: ANN001, ANN205 - autograd's
        """u, delta (g, rows, L, c); A (g, c, n); B, C (g, rows, L, n) -> (g, rows, L or 1, c)."""
        if len({t.dtype for t in (u, delta, A, B, C)}) != 1:
            raise TypeError(
                "the fused scan takes one dtype, got "
                + ", ".join(str(t.dtype) for t in (u, delta, A, B, C))
            )
        u, delta, A, B, C = (t.contiguous() for t in (u, delta, A, B, C))
        groups, rows, steps, channels = u.shape
        n = A.shape[-1]
        y = u.new_empty(groups, rows, 1 if last_only else steps, channels)
        kernel = getattr(library(), f"scan_forward_{_variant(u.dtype, n)}")
        flags = (steps, channels, n, int(last_only), int(softplus))
        threads = _threads(rows)
        work = u.new_empty(threads, steps * channels)
        pointers = [_pointer(t) for t in (u, delta, A, B, C, y, work)]
        kernel(*_sizes(groups, rows, threads, *flags), *pointers)
        ctx.save_for_backward(u, delta, A, B, C)
        ctx.flags = flags
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205 - autograd's signature
        """Gradients of u, delta (the raw step size with softplus), A, B and C."""
        u, delta, A, B, C = ctx.saved_tensors
        dy = dy.contiguous()
        groups, rows, steps, channels = u.shape
        n = A.shape[-1]
        du, ddelta, dB, dC = (torch.empty_like(t) for t in (u, delta, B, C))
        threads = _threads(rows)
        dA_parts = A.new_zeros(threads, *A.shape)  # each thread sums its own rows
        work = u.new_empty(threads, 2 * steps * n + steps * channels)
        kernel = getattr(library(), f"scan_backward_{_variant(u.dtype, n)}")
        pointers = [_pointer(t) for t in (u, delta, A, B, C, dy, du, ddelta, dA_parts)]
        pointers += [_pointer(dB), _pointer(dC), _pointer(work)]
        kernel(*_sizes(groups, rows, threads, *ctx.flags), *pointers)
        return du, ddelta, dA_parts.sum(0), dB, dC, None, None


class FusedConvSilu(torch.autograd.Function):
    """SiLU(bias + sum_j taps_j x_{t - (width - 1) + j}) per channel, channels last."""

    @staticmethod
    def forward(ctx, x, taps, bias):  # noqa: ANN001, ANN205 - autograd's signature
        """x (g, rows, L, c), taps (g, width, c), bias (g, c) -> (g, rows, L, c)."""
        if len({t.dtype for t in (x, taps, bias)}) != 1:
            raise TypeError(
                "the fused conv takes one dtype, got "
                + ", ".join(str(t.dtype) for t in (x, taps, bias))
            )
        x, taps, bias = (t.contiguous() for t in (x, taps, bias))
        groups, rows, steps, channels = x.shape
        out = torch.empty_like(x)
        kernel = getattr(library(), f"conv_forward_{_SUFFIX[x.dtype]}")
        sizes = (steps, channels, taps.shape[1])
        kernel(*_sizes(groups, rows, _threads(rows), *sizes), *map(_pointer, (x, taps, bias, out)))
        ctx.save_for_backward(x, taps, bias)
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205 - autograd's signature
        """Gradients of x, the taps and the bias."""
        x, taps, bias = ctx.saved_tensors
        dout = dout.contiguous()
        groups, rows, steps, channels = x.shape
        threads = _threads(rows)
        dx = torch.empty_like(x)
        dtaps_parts = taps.new_zeros(threads, *taps.shape)
        dbias_parts = bias.new_zeros(threads, *bias.shape)
        work = x.new_empty(threads, steps * channels)
        kernel = getattr(library(), f"conv_backward_{_SUFFIX[x.dtype]}")
        pointers = map(_pointer, (x, taps, bias, dout, dx, dtaps_parts, dbias_parts, work))
        kernel(*_sizes(groups, rows, threads, steps, channels, taps.shape[1]), *pointers)
        return dx, dtaps_parts.sum(0), dbias_parts.sum(0)


def fused_conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """SiLU(depthwise causal conv1d along the steps) per layer, channels last: x
    (g, rows, L, c), weight (g, c, width) as ``MambaMixer.conv_weight``, bias (g, c)."""
    return FusedConvSilu.apply(x, weight.transpose(1, 2), bias)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused scan can take these tensors: on the CPU the C loop (float32 or 64,
    one dtype), on a CUDA device the Triton kernels."""

    if tensors and all(t.is_cuda for t in tensors):
        return all(triton_scan.available(t) for t in tensors)
    return (
        all(t.device.type == "cpu" and t.dtype in _SUFFIX for t in tensors)
        and len({t.dtype for t in tensors}) == 1
        and available()
    )


def fused_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    last_only: bool = False,
    softplus: bool = False,
) -> torch.Tensor:
    """sum_n C_t h_t channels last: u, delta (g, rows, L, c), A (g, c, n), B and C
    (g, rows, L, n) -> (g, rows, L or 1, c); ``softplus``: delta is the raw step size. On a
    CUDA device through the Triton kernels (``triton_scan``), else the C loop."""
    if A.shape[-1] > MAX_STATE:
        raise ValueError(f"the fused scan takes states of <= {MAX_STATE}, got {A.shape[-1]}")
    if u.is_cuda:
        return triton_scan.triton_scan(u, delta, A, B, C, last_only, softplus)
    return FusedScan.apply(u, delta, A, B, C, last_only, softplus)


def fused_grouped_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    decay: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    last_only: bool = False,
    softplus: bool = False,
) -> torch.Tensor:
    """``fused_scan`` for the channels-first layout of ``selective_scan``: u, delta
    (rows, g, d / g, L), decay = A (g, d / g, n), B and C (rows, g, n, L) ->
    (rows, g, d / g, L or 1)."""
    out = fused_scan(
        u.permute(1, 0, 3, 2),
        delta.permute(1, 0, 3, 2),
        decay,
        B.permute(1, 0, 3, 2),
        C.permute(1, 0, 3, 2),
        last_only,
        softplus,
    )
    return out.permute(1, 0, 3, 2)
