"""The server half of pFedSeq (Peng et al., AAAI 2025) on tensors, without any Flower code.

Round t, with the set R of clients that reported updates Delta_i^t = theta_hat_i^t - theta_i^{t-1}:

1. theta_hat_i^t = theta_i^{t-1} + Delta_i^t and the global adapter theta_g^t = sum over R of
   |D_i| / sum |D_j| * theta_hat_i^t (eq. 1).
2. Learner update (eq. 5): xi^{t-1} = SeqLearner(Delta^{t-L:t-1}; psi) is recomputed with
   gradients and psi takes one Adam step on the surrogate  -sum_{i in R} <xi_i^{t-1}, Delta_i^t>.
   Its gradient is -sum_i (d xi_i^{t-1} / d psi)^T Delta_i^t: eq. 5 with the sign that moves
   xi_i^{t-1} towards Delta_i^t, which points downhill on client i's loss (pFedHN's convention;
   eq. 5 read literally as an ascent direction handed to a minimiser would move it away).
3. Delta^t joins the history, which keeps the last L rounds (eq. 6).
4. Inference: xi^t = SeqLearner(Delta^{max(1,t-L+1):t}; psi), the last step's output (eq. 2).
5. theta_i^t = theta_g^t + xi_i^t (eq. 3) for every client; during the first W rounds
   theta_i^t = theta_g^t (Algorithm 1, lines 10-11; the learner is trained all the same).

One learner per backbone layer's adapter (``ParameterLayout.layers``); its D parameters are the
batch dimension and are processed in chunks of ``chunk-size`` rows, which bounds memory and does
not change the result (the surrogate is a sum over rows, so chunked backward passes accumulate
exactly the full gradient; one Adam step follows).

Decisions the paper leaves open:

* **Partial participation.** A client that did not report in round t enters the history with a
  zero update (its channel of Delta^t is 0) and a mask that keeps it out of eq. 1 and of the
  eq. 5 surrogate; it still receives theta_g^t + xi_i^t. The mask is kept with the history for
  the input scale below; the learner itself sees only the (zero-filled) updates.
* **Input scale** (``pfedseq-scale-input``, default on). Each layer's window is divided by the
  RMS of its reported updates (a detached scalar s over the whole window, computed before
  chunking) and the output multiplied back: xi = s * SeqLearner(Delta / s). Updates are ~1e-3
  while the pre-norms' eps is 1e-5, so without it the norms do not normalise and the learner's
  behaviour depends on the local learning rate; with it, the calibration is measured in units of
  the clients' own update size.
* **Variant A** (``pfedseq-global-aggregation = false``): theta_i^t = xi_i^t after the warm-up
  (the learner outputs the adapter itself); theta_g^t is still sent during the warm-up.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from fedfm_flower.learners.layout import LayerRange, ParameterLayout
from fedfm_flower.learners.sequence import LearnerSpec, SequenceLearner
from fedfm_flower.learners.state import (
    check_client,
    load_optimizer_tensors,
    optimizer_tensors,
    prefixed,
    unprefixed,
)

log = logging.getLogger(__name__)

AUTO_CHUNK_ELEMENTS = 1 << 26  # activation elements kept per chunk when chunk-size = 0
MIN_CHUNK_ROWS = 64
SQUARE_SUM_BLOCK = 1 << 22  # elements per float64 block when summing squares


@dataclass(frozen=True)
class PFedSeqSettings:
    """pFedSeq's server hyperparameters (run-config keys ``pfedseq-*``)."""

    seq_len: int = 10
    warmup_rounds: int = 5
    lr: float = 1e-3
    global_aggregation: bool = True
    scale_input: bool = True
    chunk_size: int = 0
    learner: LearnerSpec = field(default_factory=LearnerSpec)

    @classmethod
    def from_config(cls, config) -> PFedSeqSettings:  # noqa: ANN001 - ExperimentConfig
        """The settings of a validated ``ExperimentConfig``."""
        spec = LearnerSpec(
            kind=config.pfedseq_learner,
            num_layers=config.pfedseq_num_layers,
            state_dim=config.pfedseq_state_dim,
            expand=config.pfedseq_expand,
            conv_kernel=config.pfedseq_conv_kernel,
            mlp_hidden=config.pfedseq_mlp_hidden,
            seq_len=config.pfedseq_seq_len,
            cross_client=config.pfedseq_cross_client,
            backend=config.pfedseq_scan_backend,
        )
        return cls(
            seq_len=config.pfedseq_seq_len,
            warmup_rounds=config.pfedseq_warmup_rounds,
            lr=config.pfedseq_lr,
            global_aggregation=config.pfedseq_global_aggregation,
            scale_input=config.pfedseq_scale_input,
            chunk_size=config.pfedseq_chunk_size,
            learner=spec,
        )


class PFedSeqServer:
    """Learners, history, global and personalized adapters of one pFedSeq run."""

    def __init__(
        self,
        settings: PFedSeqSettings,
        initial_adapter: dict[str, torch.Tensor],
        num_clients: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_clients < 1:
            raise ValueError(f"pFedSeq needs at least one client, got {num_clients}")
        self.settings = settings
        self.num_clients = num_clients
        self.device = torch.device(device)
        self.layout = ParameterLayout(initial_adapter)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.learners = nn.ModuleList(
                SequenceLearner(settings.learner, num_clients) for _ in self.layout.layers
            ).to(self.device)
        self.optimizer = torch.optim.Adam(self.learners.parameters(), lr=settings.lr)
        start = self.layout.flatten(initial_adapter)
        self.global_adapter = start.clone()
        self.personal = start.repeat(num_clients, 1)  # (N, D): theta_i of the last round
        self.history: list[torch.Tensor] = []  # oldest first, each (D, N), on the device
        self.masks: list[torch.Tensor] = []  # each (N,), 1.0 where the client reported
        self.round = 0

    # ----------------------------------------------------------------- what clients get
    def adapter_for(self, client: int) -> dict[str, torch.Tensor]:
        """theta_client of the last completed round, as named tensors."""
        return self.layout.unflatten(self.personal[self._check_client(client)])

    def num_learner_parameters(self) -> int:
        """Learnable parameters of all learners (independent of the adapter size D)."""
        return sum(p.numel() for p in self.learners.parameters())

    # ----------------------------------------------------------------- the learner
    def chunk_rows(self, steps: int) -> int:
        """Rows of D per chunk for a window of ``steps`` (the configured size, or automatic)."""
        if self.settings.chunk_size > 0:
            return self.settings.chunk_size
        per_row = max(1, steps) * self.learners[0].elements_per_row_step()
        return max(MIN_CHUNK_ROWS, AUTO_CHUNK_ELEMENTS // per_row)

    def input_scale(self, layer: LayerRange, history: list[torch.Tensor], masks) -> float:
        """RMS of the reported updates of ``layer`` in the window (1.0 when scaling is off)."""
        if not self.settings.scale_input:
            return 1.0
        total, count = 0.0, 0.0
        for update, mask in zip(history, masks, strict=True):
            total += _square_sum(update[layer.start : layer.stop])
            count += float(mask.sum()) * layer.size
        rms = math.sqrt(total / count) if count else 0.0
        return rms if rms > 0 else 1.0

    def calibrate_rows(
        self, layer_index: int, history: list[torch.Tensor], rows: slice, scale: float
    ) -> torch.Tensor:
        """xi for ``rows`` of one layer from the window ``history``: (rows, N) on the device."""
        window = torch.stack([u[rows] for u in history], dim=1).to(self.device)
        return self.learners[layer_index](window / scale) * scale

    def calibrations(self, history: list[torch.Tensor] | None = None, masks=None) -> torch.Tensor:
        """xi for every parameter and client from a window (default: the current history)."""
        history = self.history if history is None else history
        masks = self.masks if masks is None else masks
        out = torch.empty(self.layout.size, self.num_clients)
        with torch.no_grad():
            for index, layer in enumerate(self.layout.layers):
                scale = self.input_scale(layer, history, masks)
                step = self.chunk_rows(len(history))
                for start in range(layer.start, layer.stop, step):
                    rows = slice(start, min(start + step, layer.stop))
                    out[rows] = self.calibrate_rows(index, history, rows, scale).cpu()
        return out

    def accumulate_surrogate_gradient(self, updates: torch.Tensor, mask: torch.Tensor) -> float:
        """Zero the grads, then backpropagate -sum_{i reported} <xi_i^{t-1}, Delta_i^t>.

        ``updates`` is (D, N) with zeros for clients that did not report, ``mask`` (N,). The
        window is the current history (Delta^{t-L:t-1}). Returns the surrogate's value
        sum <xi_i^{t-1}, Delta_i^t> (before the step).
        """
        self.optimizer.zero_grad(set_to_none=False)
        weights = (updates * mask).to(self.device)
        value = 0.0
        for index, layer in enumerate(self.layout.layers):
            scale = self.input_scale(layer, self.history, self.masks)
            step = self.chunk_rows(len(self.history))
            for start in range(layer.start, layer.stop, step):
                rows = slice(start, min(start + step, layer.stop))
                xi = self.calibrate_rows(index, self.history, rows, scale)
                inner = (xi * weights[rows]).sum()
                (-inner).backward()
                value += float(inner.detach())
        return value

    # ----------------------------------------------------------------- one round
    def step(
        self, updates: dict[int, torch.Tensor], num_examples: dict[int, int]
    ) -> dict[str, float]:
        """Apply round t's updates (flat vectors keyed by client); returns round statistics."""
        started = time.perf_counter()
        if not updates:
            raise ValueError("pFedSeq step needs at least one client update")
        reported = sorted(self._check_client(c) for c in updates)
        update_matrix = torch.zeros(self.layout.size, self.num_clients)
        mask = torch.zeros(self.num_clients)
        for client in reported:
            update_matrix[:, client] = updates[client].float()
            mask[client] = 1.0
        self.round += 1
        stats: dict[str, float] = {"pfedseq-round": float(self.round)}

        # eq. 1 over the reporting clients (float64 accumulation, O(D) extra memory)
        weights = {c: float(num_examples.get(c, 0)) for c in reported}
        if sum(weights.values()) <= 0:
            weights = dict.fromkeys(reported, 1.0)
        total = sum(weights.values())
        accumulated = torch.zeros(self.layout.size, dtype=torch.float64)
        for client in reported:
            updated = self.personal[client].double() + update_matrix[:, client].double()
            accumulated += updated * (weights[client] / total)
        self.global_adapter = accumulated.float()

        # eq. 5: one Adam step on the surrogate, from the window that produced xi^{t-1}
        if self.history:
            surrogate = self.accumulate_surrogate_gradient(update_matrix, mask)
            grads_finite = all(
                torch.isfinite(p.grad).all()
                for p in self.learners.parameters()
                if p.grad is not None
            )
            if grads_finite:
                self.optimizer.step()
            else:
                log.warning(
                    "round %d: non-finite learner gradient; learner step skipped", self.round
                )
            stats["pfedseq-surrogate"] = surrogate
        self.history.append(update_matrix.to(self.device))
        self.masks.append(mask)
        del self.history[: -self.settings.seq_len]
        del self.masks[: -self.settings.seq_len]

        # eqs. 2/6 and 3, or the global adapter during the warm-up
        warmup = self.round <= self.settings.warmup_rounds
        stats["pfedseq-warmup"] = float(warmup)
        if warmup:
            self.personal = self.global_adapter.repeat(self.num_clients, 1)
        else:
            xi = self.calibrations().t()  # (N, D)
            if not torch.isfinite(xi).all():
                log.error(
                    "round %d: the learner produced non-finite calibrations; sending the global "
                    "adapter this round (lower pfedseq-lr?)",
                    self.round,
                )
                self.personal = self.global_adapter.repeat(self.num_clients, 1)
            elif self.settings.global_aggregation:
                self.personal = (self.global_adapter[None, :] + xi).contiguous()
                stats["pfedseq-calibration-rms"] = float(xi.pow(2).mean().sqrt())
            else:
                self.personal = xi.contiguous()
        stats["pfedseq-update-rms"] = float(update_matrix[:, reported].pow(2).mean().sqrt())
        stats["pfedseq-server-seconds"] = time.perf_counter() - started
        return stats

    # ----------------------------------------------------------------- state
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything needed to resume exactly: adapters, history, learners, Adam, round."""
        size, n = self.layout.size, self.num_clients
        tensors: dict[str, torch.Tensor] = {
            "round": torch.tensor(self.round, dtype=torch.int64),
            "global": self.global_adapter.clone(memory_format=torch.contiguous_format),
            "personal": self.personal.clone(memory_format=torch.contiguous_format),
            "history": torch.stack(self.history).cpu() if self.history else torch.zeros(0, size, n),
            "masks": torch.stack(self.masks) if self.masks else torch.zeros(0, n),
        }
        return {
            **tensors,
            **prefixed(self.learners, "learner"),
            **optimizer_tensors(self.optimizer),
        }

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore a state written by ``state_tensors`` (same settings and layout)."""
        personal = tensors["personal"]
        if personal.shape != self.personal.shape:
            raise ValueError(
                f"checkpoint has adapters of shape {tuple(personal.shape)}, this run expects "
                f"{tuple(self.personal.shape)} (num clients x adapter size)"
            )
        self.round = int(tensors["round"])
        self.global_adapter = tensors["global"].clone()
        self.personal = personal.clone()
        self.history = [h.to(self.device, copy=True) for h in tensors["history"]]
        self.masks = [m.clone() for m in tensors["masks"]]
        self.learners.load_state_dict(unprefixed(tensors, "learner"))
        load_optimizer_tensors(self.optimizer, tensors)

    def _check_client(self, client: int) -> int:
        return check_client(client, self.num_clients, "pFedSeq")


def _square_sum(block: torch.Tensor) -> float:
    """Sum of squares in float64, in blocks so no full float64 copy is made."""
    flat = block.reshape(-1)
    return sum(
        float(flat[i : i + SQUARE_SUM_BLOCK].double().pow(2).sum())
        for i in range(0, flat.numel(), SQUARE_SUM_BLOCK)
    )
