"""The Mamba mixer (Gu and Dao 2023, "Mamba simple"): the token mixer of pFedSeq's learner.

Input and output are (batch, L, width). Inside: a linear in-projection to 2 * expand * width
split into two branches; on the first a depthwise causal conv1d along the steps, SiLU and the
selective SSM whose step size, B and C depend on the input; the second gates the SSM output
through SiLU; a linear out-projection back to ``width``. Initialisation follows the reference
implementation (``mamba_ssm.modules.mamba_simple.Mamba``): PyTorch's default (Kaiming-uniform)
in-, x- and out-projections and depthwise conv, S4D-real A (A_log = log 1..n), step sizes
log-uniform in [1e-3, 1e-1] (floor 1e-4) through the inverse softplus of dt_proj's bias,
dt_proj's weight uniform in +-dt_rank^-0.5, D = 1. The residual stack that owns the mixer
re-initialises the out-projection (``fedfm_flower.learners.sequence``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedfm_flower.learners.selective_scan import causal_conv1d_silu, selective_scan

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4


class MambaMixer(nn.Module):
    """One Mamba mixer: projections, causal conv, selective SSM, gate."""

    def __init__(
        self,
        width: int,
        state_dim: int = 16,
        expand: int = 2,
        conv_kernel: int = 4,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        inner = expand * width
        self.inner = inner
        self.state_dim = state_dim
        self.dt_rank = math.ceil(width / 16)
        self.backend = backend
        self.in_proj = nn.Linear(width, 2 * inner, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(inner, conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(inner))
        bound = 1.0 / math.sqrt(conv_kernel)  # nn.Conv1d's default for a depthwise kernel
        nn.init.uniform_(self.conv_weight, -bound, bound)
        nn.init.uniform_(self.conv_bias, -bound, bound)
        self.x_proj = nn.Linear(inner, self.dt_rank + 2 * state_dim, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, inner, bias=True)
        nn.init.uniform_(self.dt_proj.weight, -(self.dt_rank**-0.5), self.dt_rank**-0.5)
        dt = torch.exp(
            torch.rand(inner) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)
        ).clamp(min=DT_FLOOR)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        a = torch.arange(1, state_dim + 1, dtype=torch.float32).repeat(inner, 1)
        self.A_log = nn.Parameter(torch.log(a))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, width, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(batch, L, width) -> (batch, L, width)."""
        x, z = self.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)  # (batch, inner, L) each
        x = causal_conv1d_silu(x, self.conv_weight, self.conv_bias, self.backend)
        dt, B, C = self.x_proj(x.transpose(1, 2)).split(
            [self.dt_rank, self.state_dim, self.state_dim], dim=-1
        )
        delta = (dt @ self.dt_proj.weight.t()).transpose(1, 2)  # (batch, inner, L), no bias yet
        y = selective_scan(
            x,
            delta,
            -torch.exp(self.A_log.float()),
            B.transpose(1, 2).contiguous(),
            C.transpose(1, 2).contiguous(),
            self.D,
            z,
            delta_bias=self.dt_proj.bias,
            delta_softplus=True,
            backend=self.backend,
        )
        return self.out_proj(y.transpose(1, 2))
