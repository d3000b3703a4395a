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

**Layer batching** (``batch_layers``, default true). The layers' learners share one architecture
and parameter shapes, so they run as one batched learner (``fedfm_flower.learners.stacked``):
their parameters are stacked along a leading layer axis, linear maps become batched matmuls and
the layers are folded into the channels of the causal conv and the selective scan (one B, C
group per layer), for the calibrations and for the eq. 5 backward pass alike. A chunk then holds
the same rows of every layer that still has rows (``chunk-size`` rows in all, split over the
layers); layers with fewer rows are padded with zero rows and a mask, which drops them from the
calibrations and gives them zero weight in the surrogate, so no grouping by size is needed. The
gradients go back to each layer's own parameters, so the optimizer, its state and the
checkpoints (``state_tensors``) are the same as the per-layer loop's, and a checkpoint of either
path resumes on the other. ``batch_layers = False`` runs the per-layer loop, one learner and one
chunk at a time: the reference, equal within float32 rounding (``tests/test_pfedseq.py``).

**One forward pass per round.** The eq. 5 surrogate of round t differentiates
xi^{t-1} = SeqLearner(Delta^{t-L:t-1}; psi), and that is exactly the inference of round t - 1:
the same window and the same psi (the Adam step of round t - 1 came before it). With the
full-batch update on the batched path, when one chunk covers the window, the inference keeps its
graph (``HeldForward``) and round t's surrogate backpropagates through it instead of running the
learner again: the same numbers, one learner forward fewer per round. Otherwise (several chunks,
the warm-up, a resumed run, mini-batches) the surrogate recomputes its forward pass.

Decisions the paper leaves open:

* **Partial participation.** A client that did not report in round t enters the history with a
  zero update (its channel of Delta^t is 0) and a mask that keeps it out of eq. 1 and of the
  eq. 5 surrogate; it still receives theta_g^t + xi_i^t. The mask is kept with the history for
  the optional input scale below; the learner itself sees only the (zero-filled) updates.
* **Units of the calibration** (``pfedseq-input-scale``). The default, ``none``, is the paper's
  (eqs. 2-3): the learner reads the raw updates and its output is xi, in the units of the
  adapter. ``rms`` divides each layer's window by the RMS of its reported updates (a detached
  scale computed before chunking: one scalar over all clients, or each client's own without
  cross-client modelling, so variant C mixes no clients) and still reads the output as xi.
  ``rms-rescale`` (this project's earlier default) also multiplies the output back,
  xi = s * SeqLearner(Delta / s): with zero-initialised output projections Adam's ~lr steps on
  them then move xi by ~lr * s per round, about 0.1% of an update, and the calibrations were
  ~1% of an update at round 20 on the offline setups: inert (docs/results.md). ``none`` was chosen
  by experiment: on the quadratic federation (``bench.pfedseq_quadratic``) it gives 0.41-0.56 of
  FedAvg's personalized error from round 11 to 40 against 0.45-0.87 for ``rms`` and 0.98-1.0
  for ``rms-rescale``; docs/results.md has the offline ViT figures. With updates of ~1e-3 the
  pre-norms' eps (1e-5) is not negligible, so the norms do not fully normalise the raw input;
  that is the paper's recipe, and it is what made the learner act.
* **Learner update** (``pfedseq-learner-update``): ``full-batch`` (default) is one Adam step per
  round on the surrogate summed over all D rows (the paper's Table 4 discussion: "a single-step
  full-batch update"); ``mini-batch`` is the appendix's memory remedy read literally,
  ceil(D / ``batch-rows``) Adam steps of ``batch-rows`` shuffled rows per layer and round.
* **Variant A** (``pfedseq-global-aggregation = false``): theta_i^t = xi_i^t after the warm-up
  (the learner outputs the adapter itself); theta_g^t is still sent during the warm-up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from fedfm_flower.learners.chunks import budget_elements
from fedfm_flower.learners.layout import LayerRange, ParameterLayout
from fedfm_flower.learners.selective_scan import check_compiled, use_fused
from fedfm_flower.learners.sequence import LearnerSpec, SequenceLearner
from fedfm_flower.learners.stacked import StackedLearners
from fedfm_flower.learners.state import (
    check_client,
    load_optimizer_tensors,
    optimizer_tensors,
    prefixed,
    unprefixed,
)
from fedfm_flower.methods.pfedseq import PFedSeqSettings

log = logging.getLogger(__name__)

MIN_CHUNK_ROWS = 64
SQUARE_SUM_BLOCK = 1 << 22  # elements per float64 block when summing squares


@dataclass
class HeldForward:
    """The graph of round ``round``'s calibrations, kept for the next round's surrogate."""

    round: int
    stacked: dict[str, torch.Tensor]  # the learners' parameters, leaves of the graph
    xi: torch.Tensor  # (G, r, N), with its graph
    index: torch.Tensor
    valid: torch.Tensor | None


class PFedSeqServer:
    """Learners, history, global and personalized adapters of one pFedSeq run."""

    def __init__(
        self,
        settings: PFedSeqSettings,
        initial_adapter: dict[str, torch.Tensor],
        num_clients: int,
        seed: int = 0,
        device: torch.device | str = "cpu",
        batch_layers: bool = True,
    ) -> None:
        if num_clients < 1:
            raise ValueError(f"pFedSeq needs at least one client, got {num_clients}")
        self.settings = settings
        self.num_clients = num_clients
        self.seed = seed
        self.device = torch.device(device)
        self.layout = ParameterLayout(initial_adapter)
        spec = LearnerSpec.from_settings(settings)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.learners = nn.ModuleList(
                SequenceLearner(spec, num_clients) for _ in self.layout.layers
            ).to(self.device)
        # The batched path steps every layer's learner at once: one multi-tensor Adam call.
        self.optimizer = torch.optim.Adam(
            self.learners.parameters(), lr=settings.lr, foreach=True if batch_layers else None
        )
        self.batch_layers = batch_layers
        self.stacked = StackedLearners(self.learners)
        # the fused C scan keeps no per-step states, so its chunks can be larger
        probe = torch.empty(0, device=self.device)
        self.fused_scan = settings.learner == "mamba" and use_fused(probe, settings.scan_backend)
        self.compile_seconds = 0.0  # reported apart, in the first step's statistics
        if settings.learner == "mamba" and settings.scan_backend == "compiled":
            # the width is N with or without cross-client modelling (variant C embeds to N)
            groups = len(self.layout.layers) if batch_layers else 1
            compiling = time.perf_counter()
            check_compiled(groups, settings.expand * num_clients, settings.state_dim)
            self.compile_seconds = time.perf_counter() - compiling
        start = self.layout.flatten(initial_adapter)
        self.global_adapter = start.clone()
        self.personal = start.repeat(num_clients, 1)  # (N, D): theta_i of the last round
        self.history: list[torch.Tensor] = []  # oldest first, each (D, N), on the device
        self.masks: list[torch.Tensor] = []  # each (N,), 1.0 where the client reported
        self.round = 0
        self.held: HeldForward | None = None

    # ----------------------------------------------------------------- what clients get
    def adapter_for(self, client: int) -> dict[str, torch.Tensor]:
        """theta_client of the last completed round, as named tensors."""
        return self.layout.unflatten(
            self.personal[check_client(client, self.num_clients, "pFedSeq")]
        )

    def num_learner_parameters(self) -> int:
        """Learnable parameters of all learners (independent of the adapter size D)."""
        return sum(p.numel() for p in self.learners.parameters())

    # ----------------------------------------------------------------- the learner
    def chunk_rows(self, steps: int) -> int:
        """Rows of D per chunk for a window of ``steps``: ``chunk-size``, or the device's
        budget of activation elements (``learners.chunks``) over what one row keeps."""
        if self.settings.chunk_size > 0:
            return self.settings.chunk_size
        per_row = max(1, steps) * self.learners[0].elements_per_row_step(self.fused_scan)
        return max(MIN_CHUNK_ROWS, budget_elements(self.device) // per_row)

    def input_scale(self, layer: LayerRange, history: list[torch.Tensor], masks) -> torch.Tensor:
        """Divisor of each client's channel of ``layer``'s window: (N,) on the device.

        Ones for ``input-scale = none``; otherwise the RMS of the reported updates in the
        window, over all clients (one scalar) or, without cross-client modelling (variant C),
        over each client's own updates, so that no client's input depends on another's.
        """
        ones = torch.ones(self.num_clients, device=self.device)
        if self.settings.input_scale == "none":
            return ones
        squares = torch.zeros(self.num_clients, dtype=torch.float64)
        counts = torch.zeros(self.num_clients, dtype=torch.float64)
        for update, mask in zip(history, masks, strict=True):
            squares += _column_square_sums(update[layer.start : layer.stop])
            counts += mask.double().cpu() * layer.size
        if self.settings.cross_client:
            squares, counts = squares.sum().expand(self.num_clients), counts.sum()
        rms = (squares / counts.clamp(min=1)).sqrt()
        rms = torch.where(rms > 0, rms, torch.ones_like(rms))
        return rms.float().to(self.device)

    def calibrate_rows(
        self, layer_index: int, history: list[torch.Tensor], rows: slice, scale: torch.Tensor
    ) -> torch.Tensor:
        """xi for ``rows`` of one layer from the window ``history``: (rows, N) on the device."""
        window = torch.stack([u[rows] for u in history], dim=1).to(self.device)
        xi = self.learners[layer_index](window / scale)
        return xi * scale if self.settings.input_scale == "rms-rescale" else xi

    def calibrations(self, history: list[torch.Tensor] | None = None, masks=None) -> torch.Tensor:
        """xi for every parameter and client from a window (default: the current history)."""
        history = self.history if history is None else history
        masks = self.masks if masks is None else masks
        if self.batch_layers:
            return self.batched_calibrations(history, masks)
        out = torch.empty(self.layout.size, self.num_clients)
        with torch.no_grad():
            for index, layer in enumerate(self.layout.layers):
                scale = self.input_scale(layer, history, masks)
                step = self.chunk_rows(len(history))
                for start in range(layer.start, layer.stop, step):
                    rows = slice(start, min(start + step, layer.stop))
                    out[rows] = self.calibrate_rows(index, history, rows, scale).cpu()
        return out

    def surrogate_backward(
        self, index: int, rows: torch.Tensor | slice, weights: torch.Tensor, scale: torch.Tensor
    ) -> float:
        """Backpropagate -sum <xi_i^{t-1}, Delta_i^t> over ``rows`` of layer ``index``."""
        xi = self.calibrate_rows(index, self.history, rows, scale)
        inner = (xi * weights[rows]).sum()
        (-inner).backward()
        return float(inner.detach())

    def accumulate_surrogate_gradient(self, updates: torch.Tensor, mask: torch.Tensor) -> float:
        """Zero the grads, then backpropagate -sum_{i reported} <xi_i^{t-1}, Delta_i^t>.

        ``updates`` is (D, N) with zeros for clients that did not report, ``mask`` (N,). The
        window is the current history (Delta^{t-L:t-1}). Returns the surrogate's value
        sum <xi_i^{t-1}, Delta_i^t> (before the step).
        """
        self.optimizer.zero_grad(set_to_none=False)
        weights = (updates * mask).to(self.device)
        if self.batch_layers:
            return self.batched_surrogate_gradient(weights)
        value = 0.0
        for index, layer in enumerate(self.layout.layers):
            scale = self.input_scale(layer, self.history, self.masks)
            step = self.chunk_rows(len(self.history))
            for start in range(layer.start, layer.stop, step):
                rows = slice(start, min(start + step, layer.stop))
                value += self.surrogate_backward(index, rows, weights, scale)
        return value

    def full_batch_update(self, updates: torch.Tensor, mask: torch.Tensor) -> float:
        """One Adam step on the whole surrogate (gradients accumulated over the chunks)."""
        value = self.accumulate_surrogate_gradient(updates, mask)
        self.optimizer_step()
        return value

    def mini_batch_updates(self, updates: torch.Tensor, mask: torch.Tensor) -> float:
        """ceil(D_layer / batch-rows) Adam steps per layer, each on a shuffled batch of rows.

        Rows are shuffled per layer with a generator seeded by (seed, round, layer), so a run is
        reproducible and resumes exactly. Only the layer's own learner takes a step (the other
        learners' gradients are ``None``, which Adam skips).
        """
        weights = (updates * mask).to(self.device)
        if self.batch_layers:
            return self.batched_mini_batch_updates(weights)
        value = 0.0
        for index, layer in enumerate(self.layout.layers):
            scale = self.input_scale(layer, self.history, self.masks)
            for batch in self.row_order(index).split(self.settings.batch_rows):
                self.optimizer.zero_grad(set_to_none=True)
                value += self.surrogate_backward(index, batch, weights, scale)
                self.optimizer_step()
        return value

    def row_order(self, index: int) -> torch.Tensor:
        """Layer ``index``'s rows (flat indices) shuffled for this round's mini-batches."""
        layer = self.layout.layers[index]
        generator = torch.Generator().manual_seed(
            self.seed * 1_000_003 + self.round * 1_009 + index
        )
        return layer.start + torch.randperm(layer.size, generator=generator)

    # ----------------------------------------------------------------- layer batching
    def layer_chunks(self, steps: int) -> list[list[tuple[int, torch.Tensor]]]:
        """The batched path's chunks: (layer index, flat row indices) of every layer in each.

        ``chunk_rows(steps)`` rows in all per chunk, split evenly over the layers; chunk k holds
        rows [k * r, (k + 1) * r) of every layer with more than k * r rows.
        """
        layers = self.layout.layers
        per_layer = max(1, self.chunk_rows(steps) // len(layers))
        longest = max(layer.size for layer in layers)
        count = -(-longest // per_layer)
        rows = -(-longest // count)
        return [
            [
                (
                    index,
                    torch.arange(
                        layer.start + offset, min(layer.stop, layer.start + offset + rows)
                    ),
                )
                for index, layer in enumerate(layers)
                if layer.size > offset
            ]
            for offset in range(0, longest, rows)
        ]

    def gather_rows(
        self, rows: list[torch.Tensor], sources: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``sources`` (each (D, N)) at each layer's ``rows``, zero-padded: (G, r, len, N).

        Returns the stacked rows, the (G, r) flat row index (padding points at a real row) and
        the (G, r) mask of real rows, or None when no layer needed padding.
        """
        width = max(len(r) for r in rows)
        index = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for position, own in enumerate(rows):
            index[position, : len(own)] = own
            index[position, len(own) :] = own[0]
            valid[position, : len(own)] = True
        index = index.to(self.device)
        flat = index.flatten()
        out = torch.stack([source.index_select(0, flat) for source in sources], dim=1)
        out = out.view(len(rows), width, len(sources), -1)
        if bool(valid.all()):
            return out, index, None
        valid = valid.to(self.device)
        return out.masked_fill_(~valid[:, :, None, None], 0.0), index, valid

    def layer_scales(self, history: list[torch.Tensor], masks) -> torch.Tensor:
        """Every layer's ``input_scale``: (layers, N) on the device."""
        return torch.stack(
            [self.input_scale(layer, history, masks) for layer in self.layout.layers]
        )

    def batched_calibrate(
        self,
        params: dict[str, torch.Tensor],
        chunk: list[tuple[int, torch.Tensor]],
        history: list[torch.Tensor],
        scales: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """xi (G, r, N) of one chunk's layers, with ``gather_rows``' index and mask."""
        layers = [index for index, _ in chunk]
        window, index, valid = self.gather_rows([rows for _, rows in chunk], history)
        scale = scales[layers][:, None, None, :]  # (G, 1, 1, N)
        xi = self.stacked(params, window / scale)
        if self.settings.input_scale == "rms-rescale":
            xi = xi * scale[:, :, 0]
        return xi, index, valid

    def chunk_parameters(
        self, stacked: dict[str, torch.Tensor], positions: list[int]
    ) -> dict[str, torch.Tensor]:
        """The entries ``positions`` of the stacked parameters' layer axis (all: ``stacked``)."""
        if positions == list(range(len(next(iter(stacked.values()))))):
            return stacked
        chosen = torch.tensor(positions, device=self.device)
        return {name: value.index_select(0, chosen) for name, value in stacked.items()}

    def batched_calibrations(self, history: list[torch.Tensor], masks) -> torch.Tensor:
        """``calibrations`` with all layers' learners in one batched call per chunk.

        On the current window, with the full-batch update and one chunk, the graph is kept
        in ``held`` for the next round's surrogate (module docstring).
        """
        out = torch.empty(self.layout.size, self.num_clients)
        scales = self.layer_scales(history, masks)
        chunks = self.layer_chunks(len(history))
        hold = (
            self.settings.learner_update == "full-batch"
            and len(chunks) == 1
            and history is self.history
        )
        self.held = None
        with torch.set_grad_enabled(hold):
            stacked = self.stacked.stack(requires_grad=hold)
            for chunk in chunks:
                params = self.chunk_parameters(stacked, [index for index, _ in chunk])
                xi, index, valid = self.batched_calibrate(params, chunk, history, scales)
                if hold:
                    self.held = HeldForward(self.round, stacked, xi, index, valid)
                    xi = xi.detach()
                if valid is None:
                    out[index.flatten().cpu()] = xi.reshape(-1, self.num_clients).cpu()
                else:
                    out[index[valid].cpu()] = xi[valid].cpu()
        return out

    def batched_surrogate_backward(
        self,
        stacked: dict[str, torch.Tensor],
        chunk: list[tuple[int, torch.Tensor]],
        weights: torch.Tensor,
        scales: torch.Tensor,
    ) -> float:
        """Backpropagate -sum <xi_i^{t-1}, Delta_i^t> over one chunk into ``stacked``'s grads."""
        params = self.chunk_parameters(stacked, [index for index, _ in chunk])
        xi, index, valid = self.batched_calibrate(params, chunk, self.history, scales)
        return surrogate_backward(xi, index, valid, weights)

    def batched_surrogate_gradient(self, weights: torch.Tensor) -> float:
        """``accumulate_surrogate_gradient``'s backward pass with the layers batched: through
        the previous round's held inference graph when there is one, else recomputed."""
        held, self.held = self.held, None
        if held is not None and held.round == self.round - 1:
            value = surrogate_backward(held.xi, held.index, held.valid, weights)
            self.stacked.scatter_gradients(held.stacked)
            return value
        scales = self.layer_scales(self.history, self.masks)
        stacked = self.stacked.stack(requires_grad=True)
        value = 0.0
        for chunk in self.layer_chunks(len(self.history)):
            value += self.batched_surrogate_backward(stacked, chunk, weights, scales)
        self.stacked.scatter_gradients(stacked)
        return value

    def batched_mini_batch_updates(self, weights: torch.Tensor) -> float:
        """``mini_batch_updates`` with batch k of every layer in one call and one Adam step.

        Each layer's learner has its own parameters and Adam state, so stepping all layers on
        their k-th batch at once gives each learner the same steps as the per-layer loop; a
        layer whose gradient is not finite skips its step alone, as in the loop.
        """
        scales = self.layer_scales(self.history, self.masks)
        orders = [
            self.row_order(index).split(self.settings.batch_rows)
            for index in range(len(self.layout.layers))
        ]
        value = 0.0
        for step in range(max(len(order) for order in orders)):
            chunk = [
                (index, order[step]) for index, order in enumerate(orders) if step < len(order)
            ]
            layers = [index for index, _ in chunk]
            self.optimizer.zero_grad(set_to_none=True)
            stacked = self.stacked.stack(layers, requires_grad=True)
            chunk_all = [(position, rows) for position, (_, rows) in enumerate(chunk)]
            value += self.batched_surrogate_backward(stacked, chunk_all, weights, scales[layers])
            finite = self.stacked.finite_gradients(stacked)
            if not bool(finite.all()):
                log.warning(
                    "round %d: non-finite learner gradient; learner step skipped", self.round
                )
            kept = [position for position in range(len(layers)) if finite[position]]
            self.stacked.scatter_gradients(stacked, [layers[p] for p in kept], kept)
            self.optimizer.step()
        return value

    def optimizer_step(self) -> None:
        """An Adam step, skipped (with a warning) when a gradient is not finite."""
        grads = [p.grad.flatten() for p in self.learners.parameters() if p.grad is not None]
        if not grads or bool(torch.isfinite(torch.cat(grads)).all()):
            self.optimizer.step()
        else:
            log.warning("round %d: non-finite learner gradient; learner step skipped", self.round)

    # ----------------------------------------------------------------- one round
    def step(
        self, updates: dict[int, torch.Tensor], num_examples: dict[int, int]
    ) -> dict[str, float]:
        """Apply round t's updates (flat vectors keyed by client); returns round statistics."""
        started = time.perf_counter()
        if not updates:
            raise ValueError("pFedSeq step needs at least one client update")
        reported = sorted(check_client(c, self.num_clients, "pFedSeq") for c in updates)
        columns = torch.tensor(reported)
        received = torch.stack([updates[c].float() for c in reported])  # (R, D)
        update_matrix = torch.zeros(self.layout.size, self.num_clients)
        update_matrix[:, columns] = received.t()
        mask = torch.zeros(self.num_clients)
        mask[columns] = 1.0
        self.round += 1
        stats: dict[str, float] = {"pfedseq-round": float(self.round)}

        # eq. 1 over the reporting clients
        weights = torch.tensor([float(num_examples.get(c, 0)) for c in reported])
        if float(weights.sum()) <= 0:
            weights = torch.ones(len(reported))
        self.global_adapter = weighted_sum(
            self.personal[columns], received, weights.double() / weights.double().sum()
        )

        # eq. 5 on the surrogate, from the window that produced xi^{t-1}
        if self.history:
            held = self.held is not None and self.held.round == self.round - 1
            stats["pfedseq-forward-held"] = float(held and self.batch_layers)
            if self.settings.learner_update == "full-batch":
                surrogate = self.full_batch_update(update_matrix, mask)
            else:
                surrogate = self.mini_batch_updates(update_matrix, mask)
            stats["pfedseq-surrogate"] = surrogate
        self.history.append(update_matrix.to(self.device))
        self.masks.append(mask)
        del self.history[: -self.settings.seq_len]
        del self.masks[: -self.settings.seq_len]

        update_rms = float(update_matrix[:, reported].pow(2).mean().sqrt())
        stats["pfedseq-update-rms"] = update_rms

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
            else:
                self.personal = xi.contiguous()
            calibration_rms = float(xi.pow(2).mean().sqrt())
            stats["pfedseq-calibration-rms"] = calibration_rms
            if update_rms > 0:
                stats["pfedseq-calibration-ratio"] = calibration_rms / update_rms
        stats["pfedseq-server-seconds"] = time.perf_counter() - started
        if self.compile_seconds:  # paid when the server was built, once per run
            stats["pfedseq-compile-seconds"], self.compile_seconds = self.compile_seconds, 0.0
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
        self.held = None
        self.learners.load_state_dict(unprefixed(tensors, "learner"))
        load_optimizer_tensors(self.optimizer, tensors)


def weighted_sum(
    personal: torch.Tensor, received: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Eq. 1: sum_i w_i (theta_i + Delta_i) for (R, D) adapters and updates, accumulated in
    float64 one block of columns at a time (O(R x block) extra memory); float32 out."""
    out = torch.empty(personal.shape[1])
    block = max(1, SQUARE_SUM_BLOCK // max(1, personal.shape[0]))
    for start in range(0, personal.shape[1], block):
        part = slice(start, start + block)
        summed = personal[:, part].double() + received[:, part].double()
        out[part] = (weights @ summed).float()
    return out


def surrogate_backward(
    xi: torch.Tensor, index: torch.Tensor, valid: torch.Tensor | None, weights: torch.Tensor
) -> float:
    """Backpropagate -sum <xi, Delta> for a chunk's xi (G, r, N) at flat rows ``index``
    (padding masked by ``valid``) against ``weights`` (D, N); returns sum <xi, Delta>."""
    target = weights.index_select(0, index.flatten()).view(xi.shape)
    if valid is not None:
        target = target.masked_fill(~valid[:, :, None], 0.0)
    inner = (xi * target).sum()
    (-inner).backward()
    return float(inner.detach())


def _column_square_sums(block: torch.Tensor) -> torch.Tensor:
    """Per-column sums of squares of a (rows, N) block in float64, on the CPU, in row blocks
    so that no full float64 copy is made."""
    rows = max(1, SQUARE_SUM_BLOCK // max(1, block.shape[1]))
    total = torch.zeros(block.shape[1], dtype=torch.float64)
    for start in range(0, block.shape[0], rows):
        total += block[start : start + rows].double().pow(2).sum(0).cpu()
    return total
