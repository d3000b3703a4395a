"""The selective scan of Mamba (Gu and Dao 2023): a pure-PyTorch path and the CUDA kernels.

Both paths compute, for every batch row b, channel d and step t (layouts as in mamba-ssm):

    delta = softplus(delta + delta_bias)                     (when delta_softplus)
    h_t   = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t  (h_0 = 0, state size n)
    y_t   = <C_t, h_t> + D * u_t,   out_t = y_t * silu(z_t)

with u, delta, z of shape (batch, d, L), A of shape (d, n), B and C of shape (batch, n, L), or
(batch, g, n, L) for g groups of d / g consecutive channels that each read their own B and C
(mamba-ssm's ``ngroups``; the layer-batched learners fold one group per adapter layer into the
channels, ``fedfm_flower.learners.stacked``).

The PyTorch path is a loop over the L steps that keeps one (batch, d, n) state and builds no
(batch, d, L, n) tensors, so it stays within O(batch * d * n) memory per step; sequences here
are short (L <= 30), so the loop is cheap, and D is processed in chunks by the caller. It runs
the recurrence from an explicit zero state, also on the first step, so that A is in the graph
of every output: on a one-step window A's gradient is a real zero, as on the kernel, and not
``None`` (Adam skips a parameter whose gradient is ``None`` and does not count the step, so
the two paths would then train differently from the second step on).

The kernel path calls ``mamba_ssm``'s ``selective_scan_fn`` and ``causal_conv1d``'s
``causal_conv1d_fn`` when they are importable and the tensors live on a CUDA device.

The fused path (backend ``fused``, and ``auto`` on a CPU where a C compiler works) runs the
recurrence as one C loop per row that keeps the state in registers over the whole window,
forward and backward (``fedfm_flower.learners.fused_scan``); the eager loop stays the oracle.

The compiled path (backend ``compiled``) is the PyTorch loop with one step of the recurrence
(decay, drive, state update and read-out) compiled by ``torch.compile``: Inductor fuses the
step's element-wise work into one loop forward and a few backward, instead of a pass over the
(batch, d, n) state per operation, which is what bounds the eager loop on a CPU (about 2x less
time for the scan's forward and backward on the offline setups' shape). The step is compiled
once per (groups, channels, state size), with the batch dimension marked dynamic so chunks of
any size reuse it; results equal the eager loop's within float32 rounding (the fused loop sums
in another order). ``check_compiled`` compiles and runs the step on a tiny input, so a machine
without a working compiler is refused at start and not mid-run.

Imports inside functions keep ``causal_conv1d`` and ``mamba_ssm`` out of this module's start-up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fedfm_flower.learners import fused_scan
from fedfm_flower.learners.fused_scan import fused_grouped_scan
from fedfm_flower.methods.pfedseq import SCAN_BACKENDS as BACKENDS


@functools.lru_cache(maxsize=1)
def kernels() -> dict[str, Any]:
    """The mamba-ssm / causal-conv1d CUDA functions that are importable (maybe none)."""
    found: dict[str, Any] = {}
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

        found["selective_scan"] = selective_scan_fn
    except Exception:  # noqa: BLE001 - missing, or built for another torch/CUDA
        pass
    try:
        from causal_conv1d import causal_conv1d_fn

        found["causal_conv1d"] = causal_conv1d_fn
    except Exception:  # noqa: BLE001
        pass
    return found


def use_kernel(name: str, tensor: torch.Tensor, backend: str) -> bool:
    """Whether kernel ``name`` runs for ``tensor`` under ``backend`` (auto, torch, cuda,
    compiled, fused: cuda always tries the kernels; torch, compiled and fused never)."""
    if backend not in BACKENDS:
        raise ValueError(f"scan backend {backend!r} unknown; allowed: {', '.join(BACKENDS)}")
    if backend in ("torch", "compiled", "fused"):
        return False
    available = name in kernels() and tensor.is_cuda
    if backend == "cuda" and not available:
        raise RuntimeError(
            f"pfedseq-scan-backend = 'cuda' but the {name} kernel is not usable here (needs "
            "`pip install .[cuda]` and the learner on a CUDA device); use 'auto' or 'torch'"
        )
    return available


def use_fused(tensor: torch.Tensor, backend: str) -> bool:
    """Whether the fused recurrence runs for ``tensor`` under ``backend``: always for
    ``fused`` (an error where it cannot), for ``auto`` on a CPU where the C loop builds and on
    a CUDA device with Triton where mamba-ssm's kernel is not installed (it goes first)."""

    if backend == "fused":
        if not fused_scan.usable(tensor):
            raise RuntimeError(
                "pfedseq-scan-backend = 'fused' but the fused scan cannot run here (it needs a "
                "C compiler, `cc`, and the learner on the CPU in float32 or float64, or Triton "
                "and the learner on a CUDA device); use 'auto'"
            )
        return True
    return backend == "auto" and fused_scan.usable(tensor)


def selective_scan_torch(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    last_only: bool = False,
    compiled: bool = False,
    fused: bool = False,
) -> torch.Tensor:
    """The selective scan in plain PyTorch (see the module docstring for the equations).

    ``last_only``: only the last step's output, (batch, d, 1), with z of one step (the
    recurrence still runs over every step; the read-out, skip and gate only at the last).
    ``compiled``: each step of the recurrence through ``compiled_scan_step``; ``fused``: the
    recurrence through the fused C loop.
    """
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if delta_softplus and not fused:  # the fused loop takes the softplus itself
        delta = F.softplus(delta)
    if B.dim() == 4 or last_only or compiled or fused:
        grouped = (B, C) if B.dim() == 4 else (B.unsqueeze(1), C.unsqueeze(1))
        y = _grouped_scan(
            u,
            delta,
            A,
            *grouped,
            last_only=last_only,
            compiled=compiled,
            fused=fused,
            softplus=fused and delta_softplus,
        )
        if last_only:
            u = u[..., -1:]
    else:
        state = u.new_zeros(u.shape[0], u.shape[1], A.shape[-1])
        outputs = []
        for u_t, d_t, b_t, c_t in zip(
            u.unbind(-1), delta.unbind(-1), B.unbind(-1), C.unbind(-1), strict=True
        ):
            drive = (d_t * u_t).unsqueeze(-1) * b_t.unsqueeze(1)  # (batch, d, n)
            state = torch.exp(d_t.unsqueeze(-1) * A) * state + drive
            outputs.append(torch.einsum("bdn,bn->bd", state, c_t))
        y = torch.stack(outputs, dim=-1)
    if D is not None:
        y = y + D[:, None] * u
    if z is not None:
        y = y * F.silu(z)
    return y


def scan_step(
    state: torch.Tensor,
    u_t: torch.Tensor,
    delta_t: torch.Tensor,
    decay: torch.Tensor,
    b_t: torch.Tensor,
    c_t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t and <C_t, h_t>, per group.

    state (batch, g, d / g, n), u_t and delta_t (batch, g, d / g), decay = A (g, d / g, n),
    b_t and c_t (batch, g, n). Returns the new state and the read-out (batch, g, d / g).
    """
    drive = (delta_t * u_t).unsqueeze(-1) * b_t.unsqueeze(2)
    state = torch.exp(delta_t.unsqueeze(-1) * decay) * state + drive
    return state, torch.einsum("bgdn,bgn->bgd", state, c_t)


@functools.lru_cache(maxsize=1)
def _compiled_step() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return torch.compile(scan_step, dynamic=False)


def compiled_scan_step(
    state: torch.Tensor, *step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scan_step`` compiled by ``torch.compile``, with the batch dimension dynamic."""
    for tensor in (state, *step):
        if tensor.dim() >= 3:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
    return _compiled_step()(state, *step)


@functools.cache
def check_compiled(groups: int, channels: int, state_dim: int) -> None:
    """Run the compiled scan (forward, backward, inference) on a tiny input, or raise.

    Also compiles the step's graphs for this shape (a first step from a state without
    gradient, later steps, inference), so the learner's first round does not pay for them.
    """
    generator = torch.Generator().manual_seed(0)
    batch, steps, dim = 4, 2, groups * channels  # batch sizes 0 and 1 would be specialised

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.rand(*shape, generator=generator)).requires_grad_()

    inputs = (
        draw(batch, dim, steps),
        draw(batch, dim, steps, scale=0.1),
        -draw(dim, state_dim),
        draw(batch, groups, state_dim, steps),
        draw(batch, groups, state_dim, steps),
    )
    try:
        _grouped_scan(*inputs, compiled=True).sum().backward()
        with torch.no_grad():
            _grouped_scan(*(t.detach() for t in inputs), compiled=True)
    except Exception as error:  # noqa: BLE001 - any compiler failure: refuse with its reason
        raise RuntimeError(
            "pfedseq-scan-backend = 'compiled' but torch.compile failed here "
            f"({type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}); "
            "it needs a C++ compiler on the CPU, Triton on a GPU; use 'auto' or 'torch'"
        ) from error


def _grouped_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    last_only: bool = False,
    compiled: bool = False,
    fused: bool = False,
    softplus: bool = False,
) -> torch.Tensor:
    """sum_n C_t h_t of the recurrence with B, C of shape (batch, g, n, L): (batch, d, L).

    Without gradients (inference) the eager state is updated in place. ``last_only``:
    (batch, d, 1). ``compiled``: each step through ``compiled_scan_step``; ``fused``: the
    whole window through ``fused_scan.fused_grouped_scan``, which with ``softplus`` takes
    delta before its softplus (only the fused loop does).
    """
    if softplus and not fused:
        raise ValueError("only the fused scan takes the softplus of delta itself")
    batch, dim, steps = u.shape
    groups = B.shape[1]
    channels = (batch, groups, dim // groups)
    decay = A.reshape(groups, dim // groups, A.shape[-1])
    u, delta = u.reshape(*channels, steps), delta.reshape(*channels, steps)
    if fused:
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in (u, delta, A, B, C)))
        inputs = (t.to(dtype) for t in (u, delta, decay, B, C))  # A is float32 in the mixers
        out = fused_grouped_scan(*inputs, last_only=last_only, softplus=softplus)
        return out.reshape(batch, dim, out.shape[-1])
    in_place = not (torch.is_grad_enabled() and any(t.requires_grad for t in (u, delta, A, B, C)))
    state = u.new_zeros(*channels, A.shape[-1])
    outputs = []
    if compiled:
        # contiguous steps: the compiled graphs then do not depend on L through the strides
        per_step = [t.movedim(-1, 0).contiguous() for t in (u, delta, B, C)]
        for step, (u_t, d_t, b_t, c_t) in enumerate(zip(*per_step, strict=True)):
            state, out = compiled_scan_step(state, u_t, d_t, decay, b_t, c_t)
            if not last_only or step == steps - 1:
                outputs.append(out.reshape(batch, dim))
        return torch.stack(outputs, dim=-1)
    for step, (u_t, d_t, b_t, c_t) in enumerate(
        zip(u.unbind(-1), delta.unbind(-1), B.unbind(-1), C.unbind(-1), strict=True)
    ):
        drive = (d_t * u_t).unsqueeze(-1) * b_t.unsqueeze(2)  # (batch, g, d / g, n)
        if in_place:
            state.mul_((d_t.unsqueeze(-1) * decay).exp_()).add_(drive)
        else:
            state = torch.exp(d_t.unsqueeze(-1) * decay) * state + drive
        if not last_only or step == steps - 1:
            outputs.append(torch.einsum("bgdn,bgn->bgd", state, c_t).reshape(batch, dim))
    return torch.stack(outputs, dim=-1)


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    backend: str = "auto",
    last_only: bool = False,
) -> torch.Tensor:
    """The selective scan on the mamba-ssm kernel when usable, else in PyTorch (compiled
    step by step for backend ``compiled``).

    ``last_only``: the last step's output only, (batch, d, 1), with z of one step (the kernel
    computes every step; the gate is applied to the last one).
    """
    if use_kernel("selective_scan", u, backend):
        y = kernels()["selective_scan"](
            u.contiguous(),
            delta.contiguous(),
            A.contiguous(),
            B.contiguous(),
            C.contiguous(),
            D=None if D is None else D.float().contiguous(),
            z=None if z is None or last_only else z.contiguous(),
            delta_bias=None if delta_bias is None else delta_bias.float().contiguous(),
            delta_softplus=delta_softplus,
        )
        if not last_only:
            return y
        y = y[..., -1:]
        return y if z is None else y * F.silu(z)
    return selective_scan_torch(
        u,
        delta,
        A,
        B,
        C,
        D,
        z,
        delta_bias,
        delta_softplus,
        last_only=last_only,
        compiled=backend == "compiled",
        fused=use_fused(u, backend),
    )


def causal_conv1d_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str = "auto"
) -> torch.Tensor:
    """SiLU(depthwise causal conv1d(x)) with x (batch, d, L) and weight (d, kernel)."""
    if use_kernel("causal_conv1d", x, backend):
        return kernels()["causal_conv1d"](x.contiguous(), weight, bias, activation="silu")
    width = weight.shape[-1]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])
    return F.silu(out[..., : x.shape[-1]])
