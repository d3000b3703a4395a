"""pFedSeq's sequential learner: (rows, L, N) windows of client updates -> (rows, N) calibrations.

One row is one adapter parameter (the paper's D is the batch dimension), the N channels are the
clients, the L steps are the last rounds. Architectures (``kind``):

* ``mamba`` (the paper): ``num_layers`` residual blocks ``h <- h + Mamba(RMSNorm(h))``;
* ``lstm`` (variant E): the same blocks with an LSTM mixer (hidden ``expand * width``);
* ``mlp`` (variant D): the window, zero-padded on the left to the fixed length L and flattened to
  ``L * width`` features, through a 4-layer ReLU MLP (hidden ``mlp-hidden``; pFedHN's 4-layer
  MLP with hidden size 100, as the paper's Appendix B describes it).

The output is the blocks' contribution to the residual stream at the last step (the stream
minus its input). Choices the paper leaves open, made here:

* **The calibration starts at zero** (``output-init = zero``, the default). Output
  projections are zero-initialised and the input's own skip path is not part of the output, so
  an untrained learner gives xi = 0 and theta_i = theta_g: the end of the warm-up is
  continuous, and the learner departs from the global adapter only as far as eq. 5 moves it.
  Gradients reach every parameter from the second server step on (the usual zero-init of
  residual branches). Gu and Dao's Mamba (``mamba_ssm``), which the paper says it follows,
  initialises the out-projection Kaiming-uniform divided by sqrt(num_layers)
  (``output-init = reference``; PyTorch's default for the MLP, as pFedHN's). That was measured
  worse: on the quadratic federation (``bench.pfedseq_quadratic``) its personalized error is
  1.4-3.7x FedAvg's (2-layer Mamba, raw input) against 0.41-0.56x with zero outputs, because a
  random out-projection on the normalised updates gives calibrations ~17-63x an update from the
  first round, which the linear eq. 5 surrogate does not pull back. Everything else is as in
  ``mamba_ssm`` (see ``fedfm_flower.learners.mamba``). Keeping the skip path (xi^t = Delta^t +
  ...) was measured worse too: 54.4% against 61.6% on the offline feature-skew setup (seed 0,
  20 rounds, with the earlier rms-rescale input).
* **No final normalisation.** Mamba language models end with a norm; here the output lives in
  parameter-update space, and a norm would pin each calibration's RMS over clients to ~1.
* **Cross-client modelling off (variant C)** folds the clients into the batch: each client's
  sequence (one channel) is embedded to ``N`` channels by a linear map initialised to copies,
  run through the same blocks with weights shared by all clients, and read out by a linear map
  initialised to the mean; so capacity matches the full learner and no client's calibration
  depends on another client's updates (a test checks this).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedfm_flower.learners.mamba import MambaMixer
from fedfm_flower.methods.pfedseq import LEARNERS, OUTPUT_INITS, PFedSeqSettings

DEFAULTS = PFedSeqSettings()


@dataclass(frozen=True)
class LearnerSpec:
    """The architecture of one sequential learner (defaults: ``PFedSeqSettings``'s)."""

    kind: str = DEFAULTS.learner
    num_layers: int = DEFAULTS.num_layers
    state_dim: int = DEFAULTS.state_dim
    expand: int = DEFAULTS.expand
    conv_kernel: int = DEFAULTS.conv_kernel
    mlp_hidden: int = DEFAULTS.mlp_hidden
    seq_len: int = DEFAULTS.seq_len
    cross_client: bool = DEFAULTS.cross_client
    backend: str = DEFAULTS.scan_backend
    output_init: str = DEFAULTS.output_init

    @classmethod
    def from_settings(cls, settings: PFedSeqSettings) -> LearnerSpec:
        """The learner that ``settings`` (run-config keys ``pfedseq-*``) describe."""
        return cls(
            kind=settings.learner,
            num_layers=settings.num_layers,
            state_dim=settings.state_dim,
            expand=settings.expand,
            conv_kernel=settings.conv_kernel,
            mlp_hidden=settings.mlp_hidden,
            seq_len=settings.seq_len,
            cross_client=settings.cross_client,
            backend=settings.scan_backend,
            output_init=settings.output_init,
        )


def init_output_projection(linear: nn.Linear, how: str, num_layers: int) -> None:
    """Initialise a residual branch's output projection: ``zero`` or ``reference``.

    ``reference`` is Gu and Dao's rule for Mamba stacks (``mamba_ssm``'s ``_init_weights`` with
    ``rescale_prenorm_residual``): Kaiming-uniform (a = sqrt 5) divided by sqrt(num_layers).
    """
    with torch.no_grad():
        if how == "zero":
            nn.init.zeros_(linear.weight)
        else:
            nn.init.kaiming_uniform_(linear.weight, a=math.sqrt(5))
            linear.weight /= math.sqrt(num_layers)
        if linear.bias is not None:
            nn.init.zeros_(linear.bias)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""

    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the channels."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LSTMMixer(nn.Module):
    """An LSTM over the steps with a linear projection back to the width."""

    def __init__(self, width: int, expand: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(width, expand * width, batch_first=True)
        self.out_proj = nn.Linear(expand * width, width, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(batch, L, width) -> (batch, L, width)."""
        return self.out_proj(self.lstm(hidden)[0])


class ResidualStack(nn.Module):
    """Pre-norm residual blocks with a Mamba or LSTM mixer; their last-step contribution."""

    def __init__(self, spec: LearnerSpec, width: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(width) for _ in range(spec.num_layers))
        if spec.kind == "mamba":
            mixers = [
                MambaMixer(width, spec.state_dim, spec.expand, spec.conv_kernel, spec.backend)
                for _ in range(spec.num_layers)
            ]
        else:
            mixers = [LSTMMixer(width, spec.expand) for _ in range(spec.num_layers)]
        for mixer in mixers:
            init_output_projection(mixer.out_proj, spec.output_init, spec.num_layers)
        self.mixers = nn.ModuleList(mixers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, L, width) -> (batch, width)."""
        hidden = x
        for norm, mixer in zip(self.norms, self.mixers, strict=True):
            hidden = hidden + mixer(norm(hidden))
        return (hidden - x)[:, -1]


class MLPLearner(nn.Module):
    """Variant D: an MLP on the fixed-length window, flattened."""

    def __init__(self, spec: LearnerSpec, width: int) -> None:
        super().__init__()
        self.seq_len = spec.seq_len
        self.net = nn.Sequential(
            nn.Linear(spec.seq_len * width, spec.mlp_hidden),
            nn.ReLU(),
            nn.Linear(spec.mlp_hidden, spec.mlp_hidden),
            nn.ReLU(),
            nn.Linear(spec.mlp_hidden, spec.mlp_hidden),
            nn.ReLU(),
            nn.Linear(spec.mlp_hidden, width),
        )
        if spec.output_init == "zero":  # "reference": PyTorch's default, as pFedHN's MLP
            nn.init.zeros_(self.net[-1].weight)
            nn.init.zeros_(self.net[-1].bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, l <= L, width) -> (batch, width)."""
        missing = self.seq_len - x.shape[1]
        if missing < 0:
            raise ValueError(f"window of {x.shape[1]} steps is longer than seq-len {self.seq_len}")
        padded = F.pad(x, (0, 0, missing, 0))
        return self.net(padded.flatten(1))


class SequenceLearner(nn.Module):
    """SeqLearner(.; psi) of one adapter layer: (rows, L, N) -> (rows, N)."""

    def __init__(self, spec: LearnerSpec, num_clients: int) -> None:
        super().__init__()
        if spec.kind not in LEARNERS:
            raise ValueError(f"learner {spec.kind!r} unknown; allowed: {', '.join(LEARNERS)}")
        if spec.output_init not in OUTPUT_INITS:
            raise ValueError(
                f"output init {spec.output_init!r} unknown; allowed: {', '.join(OUTPUT_INITS)}"
            )
        self.spec = spec
        self.num_clients = num_clients
        width = num_clients
        self.embed: nn.Linear | None = None
        self.readout: nn.Linear | None = None
        if not spec.cross_client:
            self.embed = nn.Linear(1, width, bias=False)
            self.readout = nn.Linear(width, 1, bias=False)
            nn.init.ones_(self.embed.weight)
            nn.init.constant_(self.readout.weight, 1.0 / width)
        self.core = MLPLearner(spec, width) if spec.kind == "mlp" else ResidualStack(spec, width)
        self.width = width

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """Calibrations of the last step for every row and client."""
        rows, steps, clients = window.shape
        if clients != self.num_clients:
            raise ValueError(
                f"window has {clients} clients, learner was built for {self.num_clients}"
            )
        if self.embed is None:
            return self.core(window)
        per_client = window.permute(0, 2, 1).reshape(rows * clients, steps, 1)
        out = self.readout(self.core(self.embed(per_client)))
        return out.reshape(rows, clients)

    def elements_per_row_step(self, fused_scan: bool = False) -> int:
        """Activation elements one row keeps per step for the backward pass (sizes D chunks).

        The PyTorch scan keeps about four (inner x state) tensors per step and mixer (the
        state, its decay, the drive and the output product); the fused scan
        (``fused_scan``) keeps none of them, and a mixer's inner-sized tensors (projections,
        conv, step sizes, B and C, gate) come to about 24 x inner (measured: 940 elements
        per row and step at N = 10, 8,060 at N = 100, two layers); the LSTM about eight
        gate-sized ones; the MLP's activations are small next to its input.
        """
        channels = self.width * (1 if self.embed is None else self.num_clients)
        inner = channels * self.spec.expand
        if self.spec.kind == "mamba":
            per_mixer = 24 * inner if fused_scan else 4 * inner * self.spec.state_dim
            return self.spec.num_layers * per_mixer
        return 8 * self.spec.num_layers * inner
