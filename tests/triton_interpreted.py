"""Triton's scan against the C loop, run with ``TRITON_INTERPRET=1`` from the start (Triton's
interpreter must be on before Triton is imported); prints one JSON line (``test_pfedseq.py``)."""

from __future__ import annotations

import json

import torch

from fedfm_flower.learners import fused_scan, triton_scan


def compare(steps: int, last_only: bool, softplus: bool) -> dict[str, float | bool]:
    """Outputs and gradients of both scans on one random case: relative differences."""
    g = torch.Generator().manual_seed(steps * 4 + 2 * last_only + softplus)
    groups, rows, channels, n = 2, 7, 6, 16
    u = torch.randn(groups, rows, steps, channels, generator=g)
    if softplus:
        delta = torch.randn(groups, rows, steps, channels, generator=g) - 3
        delta[0, 0, 0, 0] = 25.0  # above the threshold: softplus(x) = x, gradient 1
    else:
        delta = 0.3 * torch.rand(groups, rows, steps, channels, generator=g)
    A = -torch.rand(groups, channels, n, generator=g)
    B, C = (torch.randn(groups, rows, steps, n, generator=g) for _ in range(2))
    results = []
    for scan in (fused_scan.fused_scan, triton_scan.triton_scan):
        leaves = [t.clone().requires_grad_() for t in (u, delta, A, B, C)]
        out = scan(*leaves, last_only, softplus)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        results.append((out.detach(), *torch.autograd.grad((out * weights).sum(), leaves)))
    report: dict[str, float | bool] = {}
    for name, want, got in zip(["y", "u", "delta", "A", "B", "C"], *results, strict=True):
        scale = float(want.abs().max())
        report[name] = float((got - want).abs().max()) / max(scale, 1e-30)
        report[f"{name}-scale"] = scale
    report["A-zero"] = bool((results[1][3] == 0).all())
    return report


if __name__ == "__main__":
    cases = {
        f"{steps}-{int(last_only)}-{int(softplus)}": compare(steps, last_only, softplus)
        for steps in (1, 5)
        for last_only in (False, True)
        for softplus in (False, True)
    }
    cases["works"] = {"self-check": triton_scan.works(torch.device("cpu"))}
    print(json.dumps(cases))
