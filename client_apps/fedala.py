"""FedALA's client (Zhang et al. 2023, Algorithm 1): Adaptive Local Aggregation, then FedAvg's
local training; the rule and the choices are in ``fedfm_flower.methods.fedala``.

On a train message: the model takes the received Theta on every trainable tensor below the top
p; on the top p it takes theta_hat = lerp(theta, Theta, W) with the client's kept local model
theta (the tensors it sent last time; the model's seeded initial values, the server's Theta^0,
when it has none) and its kept W (ones when none), W first learnt on a random consecutive
s-fraction of the training data (until convergence in its first ALA, one epoch later;
``ala_weights``), unless the received top tensors equal theta. Then ``SplitClient``'s joint
training, whose result is sent and kept (top p) with W. On an evaluate message: theta_hat of
the received model with the kept W, untrained.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from client_apps.base import ClientRuntime
from client_apps.split import SplitClient
from fedfm_flower.methods.fedala import FedALASettings
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.training import EvalStats, StepTally, TrainStats

W_PREFIX = "fedala-w/"  # W's tensors in client state, next to theta's by parameter name


def consecutive_sample(data, ratio: float, generator: torch.Generator):  # noqa: ANN001, ANN201
    """``int(ratio * N)`` consecutive rows of ``data`` (a ``TensorDataset``) from a random start
    in [0, N - n], as the authors' ``train_data[rand_idx:rand_idx + rand_num]``."""

    if not isinstance(data, TensorDataset):
        raise TypeError(f"FedALA samples rows of a TensorDataset, got {type(data).__name__}")
    total = len(data)
    count = int(ratio * total)
    start = int(torch.randint(0, total - count + 1, (1,), generator=generator))
    return TensorDataset(*(t[start : start + count] for t in data.tensors))


def mixed(
    local: dict[str, torch.Tensor], received: dict[str, torch.Tensor], w: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """theta_hat = theta + (Theta - theta) * W per tensor (``torch.lerp``: exact at W = 0, 1)."""
    return {n: torch.lerp(local[n], received[n].to(local[n]), w[n]) for n in w}


def ala_weights(
    runtime: ClientRuntime,
    model: TunedModel,
    local: dict[str, torch.Tensor],
    received: dict[str, torch.Tensor],
    w: dict[str, torch.Tensor],
    start_phase: bool,
    seed: int,
) -> tuple[dict[str, torch.Tensor], TrainStats]:
    """W learnt by SGD on the loss of ``model`` holding theta_hat on W's tensors (the rest as
    loaded): per batch W <- clip(W - eta dL/dtheta_hat (Theta - theta), 0, 1). One epoch over
    the sample, or (``start_phase``) epochs until ``FedALASettings.converged``. The model ends
    holding theta_hat of the final W."""
    settings = runtime.config.settings_of(FedALASettings)
    names = list(w)
    params = model.parameters_named(names)
    dev = {n: params[n].device for n in names}
    local = {n: local[n].to(dev[n], params[n].dtype) for n in names}
    glob = {n: received[n].to(dev[n], params[n].dtype) for n in names}
    gap = {n: glob[n] - local[n] for n in names}
    w = {n: w[n].to(dev[n], params[n].dtype).clone() for n in names}
    model.load_tensors(mixed(local, glob, w))
    generator = torch.Generator().manual_seed(seed)
    sample = consecutive_sample(runtime.data.train, settings.sample_ratio, generator)
    tally = StepTally()
    if len(sample) == 0:
        return w, tally.stats()
    torch.manual_seed(seed)  # dropout and other in-model randomness
    saved_flags = {name: p.requires_grad for name, p in model.named_parameters()}
    trainable = {id(p) for p in params.values()}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    model.train()
    losses: list[float] = []
    try:
        while True:
            for batch in runtime.task.batches(sample, runtime.config.batch_size, None):
                batch = tuple(t.to(runtime.device) for t in batch)
                result = runtime.task.step(model, batch)
                grads = torch.autograd.grad(result.loss, [params[n] for n in names])
                with torch.no_grad():
                    for n, g in zip(names, grads, strict=True):
                        w[n] = torch.clamp(w[n] - settings.eta * (g * gap[n]), 0, 1)
                        params[n].copy_(torch.lerp(local[n], glob[n], w[n]))
                tally.add(result)
                tally.steps += 1
                last = result.loss.item()
            losses.append(last)
            if not start_phase or settings.converged(losses):
                break
            if settings.max_epochs and len(losses) >= settings.max_epochs:
                break
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(saved_flags[name])
    return w, tally.stats()


class FedALAClient(SplitClient):
    """ALA of the received model with the kept local one, then FedAvg's local training."""

    def kept(
        self, runtime: ClientRuntime, model: TunedModel, top: list[str], lookup: dict
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """(theta, W) of the top tensors per ``lookup``: theta the last sent tensors, else the
        model's initial values (Theta^0); W None before the client's first ALA."""
        saved = runtime.store.load(**lookup)
        if saved is None:
            return model.tensors_named(top), None
        w = {n: saved[W_PREFIX + n] for n in top} if W_PREFIX + top[0] in saved else None
        return {n: saved[n] for n in top}, w

    def top(self, runtime: ClientRuntime, model: TunedModel) -> list[str]:
        """The tensors ALA mixes: the last p of this client's trainable ones."""
        return runtime.config.settings_of(FedALASettings).top(self.split(runtime, model)[0])

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """ALA (W learnt and kept), local training from theta_hat; send and keep the result."""
        model = runtime.model()  # at its initial values: theta's start when none is kept
        names = self.split(runtime, model)[0]
        top = self.top(runtime, model)
        local, w = self.kept(runtime, model, top, {"before": server_round})
        model.load_tensors(received)  # the lower layers take Theta as it is
        ala = TrainStats(0.0, {}, 0, 0, 0.0)
        if not all(torch.equal(local[n], received[n].to(local[n])) for n in top):
            start_phase = w is None
            if w is None:
                w = {n: torch.ones_like(local[n]) for n in top}
            seed = runtime.seed(server_round, salt=4)
            w, ala = ala_weights(runtime, model, local, received, w, start_phase, seed)
        stats = self.local_training(runtime, model, received, server_round)
        sent = model.tensors_named(names)
        keep = {n: sent[n] for n in top}
        if w is not None:
            keep.update({W_PREFIX + n: t.detach().cpu() for n, t in w.items()})
        runtime.store.save(server_round, keep)
        return sent, ala.then(stats)

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """theta_hat of the received model with the kept W (Theta itself when none is kept)."""
        model = runtime.model()
        top = self.top(runtime, model)
        local, w = self.kept(runtime, model, top, {"at_most": server_round})
        model.load_tensors(received)
        if w is not None:
            model.load_tensors(mixed(local, received, w))
        return runtime.evaluate(model)
