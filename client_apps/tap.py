"""TAP's client (sec. 3.2-3.3, Algorithm 1): a federated W~ and a personal X, with replacement
during FL and distillation after it.

Both W~ and X are the client's components (the parts its modality-task pairs use) of one model;
X never leaves the client and lives, with its per-pair training losses h^(p), in client state.

**Stage 1, every round** (Algorithm 1):
1. W~ := the received components; train W~ for the local schedule (tau iterations), recording
   each seen pair's training loss h^(l)_o (on the ``tap-history`` scale: the authors'
   share-weighted loss by default, or the pair's plain mean; ``fedfm_flower/methods/tap.py``
   says why the margins belong to the first); send W~.
2. For every pair o seen this round: R[o] = 1 if h^(l)_o + m_o < h^(p)_o (eq. 3; m_o by pair
   type, ``tap-margin-*``). A pair without an h^(p) yet (X has not trained on it) counts as
   h^(p) = +inf, so X starts from the first W~ that saw the pair.
3. Replacement (eq. 4): X's parameters "responsible for task o" take W~'s. A component serves
   one or more of the client's pairs (``TunedModel.group_users``: a pair's expert and task
   layer serve it alone; encoders, shared layers and shared decoders serve several).
   ``tap-replacement = paper`` (default): every component that serves a pair with R = 1 moves,
   shared ones included, as eq. 4 writes X_[i,o] := W~_[i,o] for each such o and as the
   authors' ``replace_components`` does. ``all-pairs``: a component moves only when *every* pair
   of the client that uses it has R = 1 (a shared part moves only when none of its users would
   lose by it; our reading of "minimizing interference from other modality-task pairings").
4. Train X for the local schedule, recording h^(p)_o of the pairs it saw; keep X and h^(p).

The reply's metrics carry ``replaced-<pair>`` (1 or 0) for the seen pairs: the replacement
counts of the paper's Fig. 3-4. Its ``num-examples`` is the client's training-set size, the
weight of eq. 1 (``ClientLogic.data_size``).

**Stage 2, the post-training round** (sec. 3.3): W~ := the final received components, trained for
P iterations (``tap-distill-steps``), then frozen as the teacher; X trains P iterations on eq. 6
(``fedfm_flower.tasks.distillation``) and is kept. Evaluation always uses X (W~ before X exists).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping

import torch

from client_apps.base import ClientLogic, ClientRuntime
from fedfm_flower.data.multitask import PAIRS
from fedfm_flower.methods.tap import REPLACEMENTS, TAPSettings
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.distillation import DistillationTask
from fedfm_flower.tasks.multitask import task_losses
from fedfm_flower.tasks.training import EvalStats, TrainStats

HISTORY = "tap.history."  # client-state key prefix of h^(p)_o (scalar tensors)


def replacement(
    trained: Mapping[str, float], personal: Mapping[str, float], margins: Mapping[str, float]
) -> dict[str, bool]:
    """eq. 3 for every pair W~ trained on: R[o] = h^(l)_o + m_o < h^(p)_o (+inf when X has no
    loss for o yet)."""
    return {o: loss + margins[o] < personal.get(o, math.inf) for o, loss in trained.items()}


def replaced_components(
    users: Mapping[str, frozenset[str]],
    holds: tuple[str, ...],
    replace: Mapping[str, bool],
    rule: str = "paper",
) -> set[str]:
    """The components eq. 4 copies from W~ into X (a pair without R this round does not ask):
    ``paper``, those serving any of ``holds`` with R = 1; ``all-pairs``, those whose users
    among ``holds`` all have R = 1."""
    if rule not in REPLACEMENTS:
        raise ValueError(f"replacement rule '{rule}' unknown; allowed: {', '.join(REPLACEMENTS)}")
    out = set()
    for group, serves in users.items():
        mine = serves & set(holds)
        asks = [replace.get(o, False) for o in mine]
        if mine and (any(asks) if rule == "paper" else all(asks)):
            out.add(group)
    return out


class TAPClient(ClientLogic):
    """W~ trained and sent; X kept, refreshed from W~ by eq. 3-4, distilled after FL."""

    def start(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor]
    ) -> tuple[TAPSettings, TunedModel, list[str], dict[str, torch.Tensor]]:
        """(settings, the model holding W~ := ``received``, the client's component names, their
        seeded initial values: X's start before X exists)."""
        model = runtime.model()
        names = model.names_for(runtime.task.holdings(runtime.data))
        initial = model.tensors_named(names)
        model.load_tensors(received)
        return runtime.config.settings_of(TAPSettings), model, names, initial

    def personal(
        self, runtime: ClientRuntime, **lookup: int
    ) -> tuple[dict[str, torch.Tensor] | None, dict[str, float]]:
        """(X, h^(p)) from client state (None, {} before X exists)."""
        state = runtime.store.load(**lookup)
        if state is None:
            return None, {}
        history = {k[len(HISTORY) :]: float(v) for k, v in state.items() if k.startswith(HISTORY)}
        return {k: v for k, v in state.items() if not k.startswith(HISTORY)}, history

    def keep(
        self,
        runtime: ClientRuntime,
        server_round: int,
        x: dict[str, torch.Tensor],
        history: Mapping[str, float],
    ) -> None:
        """Save X and h^(p) as the client state after ``server_round``."""
        losses = {HISTORY + o: torch.tensor(v, dtype=torch.float64) for o, v in history.items()}
        runtime.store.save(server_round, {**x, **losses})

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Stage 1: train W~ and send it; replace parts of X (eq. 3-4); train X and keep it."""

        settings, model, names, initial = self.start(runtime, received)
        w_stats = runtime.train(model, names, runtime.seed(server_round))
        sent = model.tensors_named(names)
        x, history = self.personal(runtime, before=server_round)
        margins = {o: settings.margin(PAIRS[o].type) for o in PAIRS}
        replace = replacement(task_losses(w_stats, settings.history), history, margins)
        holds = runtime.task.holdings(runtime.data)
        moved = replaced_components(model.group_users(), holds, replace, settings.replacement)
        groups = model.parameter_groups()
        x = x if x is not None else initial
        model.load_tensors({n: sent[n] if groups[n] in moved else x[n] for n in names})
        x_stats = runtime.train(model, names, runtime.seed(server_round, salt=1))
        self.keep(
            runtime,
            server_round,
            model.tensors_named(names),
            {**history, **task_losses(x_stats, settings.history)},
        )
        flags = {f"replaced-{o}": float(r) for o, r in replace.items()}
        stats = dataclasses.replace(w_stats.then(x_stats), metrics={**w_stats.metrics, **flags})
        return sent, stats

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """X on the client's test split (the received W~ before X exists)."""
        model = runtime.model()
        model.load_tensors(received)
        x, _ = self.personal(runtime, at_most=server_round)
        if x is not None:
            model.load_tensors(x)
        return runtime.evaluate(model)

    def post_train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Stage 2: W~ trained P iterations becomes the teacher; X trains P on eq. 6."""

        settings, model, names, initial = self.start(runtime, received)
        steps = settings.distill_steps
        w_stats = runtime.train(model, names, runtime.seed(server_round), steps=steps)
        teacher = copy.deepcopy(model).requires_grad_(False)
        x, history = self.personal(runtime, before=server_round)
        model.load_tensors(x if x is not None else initial)
        weights = {o: settings.distill_weight(PAIRS[o].type) for o in PAIRS}
        distill = DistillationTask(runtime.task, teacher, weights, settings.temperature)
        x_stats = runtime.train(
            model, names, runtime.seed(server_round, salt=1), steps=steps, task=distill
        )
        self.keep(runtime, server_round, model.tensors_named(names), history)
        return {}, w_stats.then(x_stats)
