"""The selective scan of Mamba (Gu and Dao 2023): a pure-PyTorch path and the CUDA kernels.

Both paths compute, for every batch row b, channel d and step t (layouts as in mamba-ssm):

    delta = softplus(delta + delta_bias)                     (when delta_softplus)
    h_t   = exp(delta_t * A) * h_{t-1} + delta_t * B_t * u_t  (h_0 = 0, state size n)
    y_t   = <C_t, h_t> + D * u_t,   out_t = y_t * silu(z_t)

with u, delta, z of shape (batch, d, L), A of shape (d, n), B and C of shape (batch, n, L).

The PyTorch path is a loop over the L steps that keeps one (batch, d, n) state and builds no
(batch, d, L, n) tensors, so it stays within O(batch * d * n) memory per step; sequences here
are short (L <= 30), so the loop is cheap, and D is processed in chunks by the caller. It runs
the recurrence from an explicit zero state, also on the first step, so that A is in the graph
of every output: on a one-step window A's gradient is a real zero, as on the kernel, and not
``None`` (Adam skips a parameter whose gradient is ``None`` and does not count the step, so
the two paths would then train differently from the second step on).

The kernel path calls ``mamba_ssm``'s ``selective_scan_fn`` and ``causal_conv1d``'s
``causal_conv1d_fn`` when they are importable and the tensors live on a CUDA device.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from fedfm_flower.learners.pfedseq_settings import SCAN_BACKENDS as BACKENDS


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
    """Whether kernel ``name`` runs for ``tensor`` under ``backend`` (auto, torch, cuda)."""
    if backend not in BACKENDS:
        raise ValueError(f"scan backend {backend!r} unknown; allowed: {', '.join(BACKENDS)}")
    if backend == "torch":
        return False
    available = name in kernels() and tensor.is_cuda
    if backend == "cuda" and not available:
        raise RuntimeError(
            f"pfedseq-scan-backend = 'cuda' but the {name} kernel is not usable here (needs "
            "`pip install .[cuda]` and the learner on a CUDA device); use 'auto' or 'torch'"
        )
    return available


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
) -> torch.Tensor:
    """The selective scan in plain PyTorch (see the module docstring for the equations)."""
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if delta_softplus:
        delta = F.softplus(delta)
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
) -> torch.Tensor:
    """The selective scan on the mamba-ssm kernel when usable, else in PyTorch."""
    if use_kernel("selective_scan", u, backend):
        return kernels()["selective_scan"](
            u.contiguous(),
            delta.contiguous(),
            A.contiguous(),
            B.contiguous(),
            C.contiguous(),
            D=None if D is None else D.float().contiguous(),
            z=None if z is None else z.contiguous(),
            delta_bias=None if delta_bias is None else delta_bias.float().contiguous(),
            delta_softplus=delta_softplus,
        )
    return selective_scan_torch(u, delta, A, B, C, D, z, delta_bias, delta_softplus)


def causal_conv1d_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str = "auto"
) -> torch.Tensor:
    """SiLU(depthwise causal conv1d(x)) with x (batch, d, L) and weight (d, kernel)."""
    if use_kernel("causal_conv1d", x, backend):
        return kernels()["causal_conv1d"](x.contiguous(), weight, bias, activation="silu")
    width = weight.shape[-1]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])
    return F.silu(out[..., : x.shape[-1]])
