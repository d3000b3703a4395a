"""All adapter layers' sequential learners as one batched learner (pFedSeq's default server path).

pFedSeq keeps one ``SequenceLearner`` per adapter layer. The learners have the same architecture
and the same parameter shapes (their width is the number of clients N, whatever the layer's size
D_l), so their parameters stack along a new leading *layer axis*: ``stack`` turns the
``ModuleList`` into one tensor per parameter name, (G, *shape) for G layers, detached from the
modules and, for the learner update, a leaf of its own whose gradient ``scatter_gradients``
hands back to each layer's parameters (the optimizer, its state and the checkpoints stay those
of the per-layer modules). ``forward`` then runs the G learners in one call on a
(G, rows, L, N) window:

* every linear map is one batched matmul (``torch.bmm`` over the layer axis);
* Mamba's depthwise causal conv1d and selective scan fold the layers into the channels,
  (rows, G * inner, L): the conv is depthwise, so that is exact, and the scan reads one B and C
  per layer through mamba-ssm's channel groups (B, C of shape (rows, G, n, L); each group is
  ``inner`` consecutive channels), so the same call runs on the CUDA kernels;
* the LSTM (variant E) is written out step by step (gates i, f, g, o as ``nn.LSTM``);
* RMSNorm, the MLP (variant D) and the per-client embedding and read-out of variant C are the
  per-layer modules' arithmetic with a layer axis.

The math is that of ``fedfm_flower.learners.sequence`` (the per-layer loop, kept as the
reference path); results agree within float32 rounding (``tests/test_pfedseq.py``).

Layers of different sizes: the learners never differ in shape, only in their number of rows
D_l. ``PFedSeqServer`` batches all layers that still have rows in a chunk and pads the shorter
ones with zero rows that are masked out: they are dropped from the calibrations and weigh zero
in the eq. 5 surrogate, so they add exactly nothing to a gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedfm_flower.learners.fused_scan import fused_conv_silu, fused_scan
from fedfm_flower.learners.selective_scan import (
    causal_conv1d_silu,
    selective_scan,
    use_fused,
    use_kernel,
)
from fedfm_flower.learners.sequence import SequenceLearner

Params = dict[str, torch.Tensor]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Layer g's ``x[g] @ weight[g].T + bias[g]`` for x (G, ..., in), weight (G, out, in)."""
    flat = x.reshape(x.shape[0], -1, x.shape[-1])
    if bias is None:
        out = torch.bmm(flat, weight.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.unsqueeze(1), flat, weight.transpose(1, 2))
    return out.reshape(*x.shape[:-1], weight.shape[1])


def to_channels(x: torch.Tensor) -> torch.Tensor:
    """(G, rows, L, c) -> (rows, G * c, L): the layers folded into the channels."""
    groups, rows, steps, width = x.shape
    return x.permute(1, 0, 3, 2).reshape(rows, groups * width, steps)


def from_channels(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(rows, G * c, L) -> (G, rows, L, c): the inverse of ``to_channels``."""
    rows, channels, steps = x.shape
    return x.reshape(rows, groups, channels // groups, steps).permute(1, 0, 3, 2)


def sub_parameters(params: Params, prefix: str) -> Params:
    """The entries of ``params`` under ``prefix``, with the prefix removed."""
    return {name[len(prefix) :]: value for name, value in params.items() if name.startswith(prefix)}


def conv_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, backend: str
) -> torch.Tensor:
    """SiLU(depthwise causal conv1d(x)), x (batch, d, L): on the CPU as shifted multiply-adds.

    The CPU's depthwise ``conv1d`` takes about twice as long as the sum of the kernel's taps
    here, backward included; on a GPU ``causal_conv1d_silu`` runs (the causal-conv1d kernel,
    or ``conv1d``).
    """
    if x.device.type != "cpu" or use_kernel("causal_conv1d", x, backend):
        return causal_conv1d_silu(x, weight, bias, backend)
    width, steps = weight.shape[-1], x.shape[-1]
    padded = F.pad(x, (width - 1, 0))
    out = torch.addcmul(bias[:, None], padded[..., :steps], weight[:, :1])
    for tap in range(1, width):
        out = torch.addcmul(out, padded[..., tap : tap + steps], weight[:, tap : tap + 1])
    return F.silu(out)


class StackedLearners:
    """The learners of a ``ModuleList`` run as one: parameters with a leading layer axis."""

    def __init__(self, learners: nn.ModuleList) -> None:
        template = learners[0]
        if not isinstance(template, SequenceLearner):
            raise TypeError(f"expected SequenceLearner modules, got {type(template).__name__}")
        self.learners = learners
        self.spec = template.spec
        self.num_clients = template.num_clients
        self.names = [name for name, _ in template.named_parameters()]
        core = template.core
        if self.spec.kind == "mamba":
            mixer = core.mixers[0]
            self.dt_rank, self.state_dim, self.inner = mixer.dt_rank, mixer.state_dim, mixer.inner
        if self.spec.kind in ("mamba", "lstm"):
            self.eps = core.norms[0].eps
            self.num_blocks = len(core.mixers)
        if self.spec.kind == "mlp":
            self.seq_len = core.seq_len

    # ----------------------------------------------------------------- parameters
    def stack(self, layers: list[int] | None = None, requires_grad: bool = False) -> Params:
        """Each parameter of ``layers`` (default: all) stacked, (G, *shape), a fresh leaf."""
        chosen = range(len(self.learners)) if layers is None else layers
        per_layer = [dict(self.learners[i].named_parameters()) for i in chosen]
        return {
            name: torch.stack([p[name].detach() for p in per_layer]).requires_grad_(requires_grad)
            for name in self.names
        }

    def finite_gradients(self, stacked: Params) -> torch.Tensor:
        """Per entry of the layer axis, whether all of its stacked gradients are finite: (G,)."""
        grads = [value.grad.flatten(1) for value in stacked.values() if value.grad is not None]
        if not grads:
            return torch.ones(len(next(iter(stacked.values()))), dtype=torch.bool)
        return torch.isfinite(torch.cat(grads, dim=1)).all(1).cpu()

    def scatter_gradients(
        self,
        stacked: Params,
        layers: list[int] | None = None,
        positions: list[int] | None = None,
    ) -> None:
        """Add the stacked leaves' gradients to the gradients of ``layers``' own parameters.

        ``positions`` are the entries of the layer axis that hold ``layers`` (default: the
        stack was made from ``layers`` in order; ``layers`` default: all learners).
        """
        chosen = list(range(len(self.learners))) if layers is None else layers
        places = list(range(len(chosen))) if positions is None else positions
        for position, index in zip(places, chosen, strict=True):
            own = dict(self.learners[index].named_parameters())
            for name in self.names:
                grad = stacked[name].grad
                if grad is None:
                    continue
                target = own[name]
                if target.grad is None:
                    target.grad = grad[position].clone()
                else:
                    target.grad.add_(grad[position])

    # ----------------------------------------------------------------- forward
    def forward(self, params: Params, window: torch.Tensor) -> torch.Tensor:
        """Calibrations (G, rows, N) of the last step from windows (G, rows, L, N)."""
        groups, rows, steps, clients = window.shape
        if clients != self.num_clients:
            raise ValueError(
                f"window has {clients} clients, learner was built for {self.num_clients}"
            )
        if self.spec.cross_client:
            return self.core(params, window)
        per_client = window.permute(0, 1, 3, 2).reshape(groups, rows * clients, steps, 1)
        embedded = per_client * params["embed.weight"][:, None, None, :, 0]
        out = linear(self.core(params, embedded), params["readout.weight"])
        return out.reshape(groups, rows, clients)

    __call__ = forward

    def core(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        """The residual stack or the MLP: (G, batch, L, width) -> (G, batch, width).

        Only the last step leaves the stack, so the last block's mixer reads out that step
        alone (its recurrence still runs over all of them): the same numbers, less work.
        """
        if self.spec.kind == "mlp":
            return self.mlp(params, x)
        mixer = self.mamba if self.spec.kind == "mamba" else self.lstm
        hidden = x
        for block in range(self.num_blocks):
            normed = self.rms_norm(hidden, params[f"core.norms.{block}.weight"])
            own = sub_parameters(params, f"core.mixers.{block}.")
            if block < self.num_blocks - 1:
                hidden = hidden + mixer(own, normed)
            else:
                hidden = hidden[:, :, -1:] + mixer(own, normed, last_only=True)
        return hidden[:, :, -1] - x[:, :, -1]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``RMSNorm`` per layer: weight (G, width)."""
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * scale * weight[:, None, None, :]

    def mamba(self, p: Params, hidden: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """``MambaMixer`` per layer: (G, batch, L, width) -> (G, batch, L or 1, width)."""
        backend = self.spec.backend
        on_cpu = hidden.device.type == "cpu"  # the fused conv is a C kernel
        if (
            on_cpu
            and not use_kernel("selective_scan", hidden, backend)
            and use_fused(hidden, backend)
        ):
            return self.mamba_channels_last(p, hidden, last_only)
        groups = hidden.shape[0]
        weight = p["in_proj.weight"]
        x = to_channels(linear(hidden, weight[:, : self.inner]))  # (batch, G * inner, L)
        z = to_channels(linear(hidden[:, :, -1:] if last_only else hidden, weight[:, self.inner :]))
        x = conv_silu(
            x, p["conv_weight"].flatten(0, 1), p["conv_bias"].flatten(), self.spec.backend
        )
        dt, B, C = linear(from_channels(x, groups), p["x_proj.weight"]).split(
            [self.dt_rank, self.state_dim, self.state_dim], dim=-1
        )
        delta = to_channels(linear(dt, p["dt_proj.weight"]))  # no bias yet
        y = selective_scan(
            x,
            delta,
            -torch.exp(p["A_log"].float()).flatten(0, 1),
            B.permute(1, 0, 3, 2).contiguous(),  # (batch, G, n, L)
            C.permute(1, 0, 3, 2).contiguous(),
            p["D"].flatten(),
            z,
            delta_bias=p["dt_proj.bias"].flatten(),
            delta_softplus=True,
            backend=self.spec.backend,
            last_only=last_only,
        )
        return linear(from_channels(y, groups), p["out_proj.weight"])

    def mamba_channels_last(
        self, p: Params, hidden: torch.Tensor, last_only: bool = False
    ) -> torch.Tensor:
        """``mamba`` on the fused C kernels, every tensor in the matmuls' (G, batch, L, c)
        layout: no folding of the layers into channels, the conv and SiLU in one kernel,
        softplus(delta + bias) inside the scan (the bias in dt_proj's matmul)."""
        weight = p["in_proj.weight"]
        x = linear(hidden, weight[:, : self.inner])  # (G, batch, L, inner)
        z = linear(hidden[:, :, -1:] if last_only else hidden, weight[:, self.inner :])
        x = fused_conv_silu(x, p["conv_weight"], p["conv_bias"])
        dt, B, C = linear(x, p["x_proj.weight"]).split(
            [self.dt_rank, self.state_dim, self.state_dim], dim=-1
        )
        delta = linear(dt, p["dt_proj.weight"], p["dt_proj.bias"])  # before the softplus
        A = -torch.exp(p["A_log"].float()).to(x.dtype)  # (G, inner, n)
        y = fused_scan(x, delta, A, B, C, last_only=last_only, softplus=True)
        u = x[:, :, -1:] if last_only else x
        y = torch.addcmul(y, u, p["D"][:, None, None, :]) * F.silu(z)
        return linear(y, p["out_proj.weight"])

    def lstm(self, p: Params, hidden: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """``LSTMMixer`` per layer (one-layer LSTM, zero initial state, then out_proj)."""
        bias = p["lstm.bias_ih_l0"] + p["lstm.bias_hh_l0"]
        inputs = linear(hidden, p["lstm.weight_ih_l0"], bias)  # (G, batch, L, 4 * h)
        recurrent = p["lstm.weight_hh_l0"]
        groups, batch, steps, _ = inputs.shape
        size = recurrent.shape[-1]
        h = inputs.new_zeros(groups, batch, size)
        c = inputs.new_zeros(groups, batch, size)
        outputs = []
        for step in range(steps):
            gates = inputs[:, :, step] + linear(h, recurrent)
            i, f, g, o = gates.chunk(4, dim=-1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        kept = outputs[-1:] if last_only else outputs
        return linear(torch.stack(kept, dim=2), p["out_proj.weight"])

    def mlp(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        """``MLPLearner`` per layer: left-pad to L steps, flatten, 4 linear layers with ReLU."""
        missing = self.seq_len - x.shape[2]
        if missing < 0:
            raise ValueError(f"window of {x.shape[2]} steps is longer than seq-len {self.seq_len}")
        out = F.pad(x, (0, 0, missing, 0)).flatten(2)
        for index in (0, 2, 4, 6):
            out = linear(out, params[f"core.net.{index}.weight"], params[f"core.net.{index}.bias"])
            if index < 6:
                out = torch.relu(out)
        return out
