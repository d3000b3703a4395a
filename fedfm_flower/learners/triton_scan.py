"""The selective scan over the whole window in one Triton kernel: pFedSeq's CUDA path without
mamba-ssm.

The eager scan launches a dozen small kernels per step, forward and backward, which bounds the
server step on a GPU (launches, not work). Here one program per (layer group, row) holds the
(channels x n) state in registers over the L steps:

    h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t,    y_t = <C_t, h_t>    (h_0 = 0)

with delta_t = softplus of the raw step size when ``softplus`` (torch's, threshold 20; the
log1p through Goldberg's ``log(w) * e / (w - 1)``, exact where 1 + e rounds to 1). Layout and
semantics are those of the fused C scan (``fedfm_flower.learners.fused_scan``): channels last,
u and delta (groups, rows, steps, channels), A (groups, channels, n), B and C (groups, rows,
steps, n), y (groups, rows, steps or 1, channels).

The backward pass keeps nothing from the forward pass: walking the window backwards, it
recomputes h_{t-1} from the window's start at every step, O(L^2) recurrence steps for O(L)
stored nothing. With L <= 30 that is at most 15x the forward's arithmetic, on a device where
the step was bound by launches, and it needs no (rows, L, channels, n) history in memory.
Every row's dB and dC are written by its own program (one program covers all channels); dA is
summed over rows with atomic adds, so its float32 sum order varies between runs (within
rounding).

Runs on a CUDA device (``available``: Triton importable and a GPU); the tests run the same
kernels on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).

Imports inside functions keep ``triton`` out of this module's start-up.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

MAX_CHANNELS = 1024  # one program covers a row's channels: (channels x n) state in registers


def _kernels() -> tuple:
    """The Triton kernels (``triton_kernels``, imported, and so Triton, on first use)."""
    from fedfm_flower.learners.triton_kernels import backward, forward

    return forward, backward


@functools.lru_cache(maxsize=1)
def importable() -> bool:
    """Whether Triton is installed (the kernels compile on first use)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(tensor: torch.Tensor) -> bool:
    """Whether the Triton scan can take ``tensor``: on a CUDA device, Triton installed, and
    the kernels compiled and checked there (``works``)."""
    return tensor.is_cuda and importable() and works(tensor.device)


@functools.cache
def works(device: torch.device) -> bool:
    """Compile the kernels on ``device`` and check them on a tiny window against the eager
    recurrence (values and gradients); False, with a warning, where either fails, so that
    ``auto`` falls back to the eager scan instead of failing mid-run."""
    try:
        generator = torch.Generator().manual_seed(0)
        groups, rows, steps, channels, n = 2, 3, 4, 5, 16
        inputs = [
            torch.randn(groups, rows, steps, channels, generator=generator),
            torch.randn(groups, rows, steps, channels, generator=generator) - 3,
            -torch.rand(groups, channels, n, generator=generator),
            torch.randn(groups, rows, steps, n, generator=generator),
            torch.randn(groups, rows, steps, n, generator=generator),
        ]
        results = []
        for scan in (_eager, triton_scan):
            leaves = [t.to(device).requires_grad_() for t in inputs]
            out = scan(*leaves, False, True)
            results.append([out, *torch.autograd.grad(out.square().sum(), leaves)])
        for got, want in zip(*results[::-1], strict=True):
            torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-4, atol=1e-5)
    except Exception as error:  # noqa: BLE001 - any compile or check failure: fall back
        log.warning("the Triton scan does not work on %s (%s); the eager scan runs", device, error)
        return False
    return True


def _eager(u, delta, A, B, C, last_only, softplus):  # noqa: ANN001, ANN202 - the check's oracle
    """The recurrence step by step in PyTorch, channels last (``works``' reference)."""
    dt = torch.nn.functional.softplus(delta) if softplus else delta
    h = u.new_zeros(*u.shape[:2], u.shape[-1], A.shape[-1])  # (g, rows, c, n)
    outputs = []
    for t in range(u.shape[2]):
        drive = (dt[:, :, t] * u[:, :, t])[..., None] * B[:, :, t, None, :]
        h = torch.exp(dt[:, :, t, :, None] * A[:, None]) * h + drive
        outputs.append((h * C[:, :, t, None, :]).sum(-1))
    y = torch.stack(outputs, dim=2)
    return y[:, :, -1:] if last_only else y


def _blocks(channels: int, n: int) -> dict[str, int]:
    import triton

    if channels > MAX_CHANNELS:
        raise ValueError(f"the Triton scan takes <= {MAX_CHANNELS} channels, got {channels}")
    return {"BLOCK_C": triton.next_power_of_2(channels), "BLOCK_N": triton.next_power_of_2(n)}


class TritonScan(torch.autograd.Function):
    """``fused_scan.FusedScan`` on a GPU: the same inputs, outputs and gradients."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, last_only, softplus):  # noqa: ANN001, ANN205 - autograd's
        """u, delta (g, rows, L, c); A (g, c, n); B, C (g, rows, L, n) -> (g, rows, L or 1, c)."""
        u, delta, A, B, C = (t.contiguous() for t in (u, delta, A, B, C))
        groups, rows, steps, channels = u.shape
        n = A.shape[-1]
        y = u.new_empty(groups, rows, 1 if last_only else steps, channels)
        forward, _ = _kernels()
        flags = {"LAST_ONLY": bool(last_only), "SOFTPLUS": bool(softplus), **_blocks(channels, n)}
        forward[(groups * rows,)](u, delta, A, B, C, y, rows, channels, steps, n, **flags)
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
        dA = torch.zeros(A.shape, dtype=torch.float32, device=A.device)
        _, backward = _kernels()
        backward[(groups * rows,)](
            u, delta, A, B, C, dy, du, ddelta, dA, dB, dC, rows, channels, steps, n, **ctx.flags
        )
        return du, ddelta, dA.to(A.dtype), dB, dC, None, None


def triton_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    last_only: bool = False,
    softplus: bool = False,
) -> torch.Tensor:
    """``fused_scan.fused_scan`` through the Triton kernels (CUDA, or Triton's interpreter)."""
    return TritonScan.apply(u, delta, A, B, C, last_only, softplus)
