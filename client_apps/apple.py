"""APPLE's client (Luo & Wu 2022): its core theta_i and its directed relationship vector p_i
descend the loss of the personalized model w_i = sum_j p_ij theta_j; the rule and the choices
are in ``fedfm_flower.methods.apple``.

A training message holds all N cores: the client's own (its last one, as the server stored it)
under the plain parameter names, every other client's under ``core_key``. On each batch of the
round's seeded local schedule, the model runs with w_i in place of its trainable tensors
(``torch.func.functional_call``: no second model), the loss gets lambda(r) mu/2 ||p_i - p_0||^2,
and the run's optimizer steps theta_i (at ``lr``) and p_i (at ``apple-p-lr``, no weight decay)
together; the other cores stay fixed. theta_i is sent; p_i is saved in client state (p_0 = 1/N
when none is saved). Evaluation: w_i of the received cores and the latest p_i, untrained.
"""

from __future__ import annotations

import torch

from client_apps.base import ClientLogic, ClientRuntime
from client_apps.stepwise import WithTensors, local_schedule
from fedfm_flower.methods.apple import AppleSettings, parse_core_key
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.base import Batch, StepResult
from fedfm_flower.tasks.training import EvalStats, TrainStats, make_optimizer

P_KEY = "apple-p"  # p_i's key in the client state (no parameter name lacks a dot)


def received_cores(
    received: dict[str, torch.Tensor], names: list[str], client_id: int
) -> list[dict[str, torch.Tensor]]:
    """The N cores of a message, by client id: this client's under ``names``, the others'
    under ``core_key``; an error names what is missing."""
    others: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in received.items():
        parsed = parse_core_key(key)
        if parsed is not None:
            others.setdefault(parsed[0], {})[parsed[1]] = tensor
    count = len(others) + 1
    if sorted(others) != [j for j in range(count) if j != client_id]:
        raise ValueError(
            f"APPLE client {client_id} got the cores of clients {sorted(others)}; it needs every "
            f"other client's of 0..{count - 1}"
        )
    others[client_id] = {n: received[n] for n in names if n in received}
    for j, core in sorted(others.items()):
        if set(core) != set(names):
            raise ValueError(f"APPLE: client {j}'s core does not hold the tensors {names}")
    return [others[j] for j in range(count)]


def initial_p(num_clients: int) -> torch.Tensor:
    """p_0: the uniform vector 1/N (the initial value and the proximal anchor)."""
    return torch.full((num_clients,), 1.0 / num_clients)


def mixture(p: torch.Tensor, stacked: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """w = sum_j p_j theta_j per tensor, ``stacked[n]`` holding theta_j[n] in row j."""
    return {n: torch.tensordot(p.to(rows.dtype), rows, dims=1) for n, rows in stacked.items()}


class AppleClient(ClientLogic):
    """The own core to the server and back; p_i in client state; w_i trained and evaluated."""

    def relationships(self, runtime: ClientRuntime, num_clients: int, lookup: dict) -> torch.Tensor:
        """p_i saved per ``lookup``, else p_0; an error when it was saved for another N."""
        saved = runtime.store.load(**lookup)
        if saved is None:
            return initial_p(num_clients)
        p = saved[P_KEY]
        if p.shape != (num_clients,):
            raise ValueError(
                f"APPLE client {runtime.identity.client_id} kept p for {p.numel()} clients, but "
                f"the server sent {num_clients} cores"
            )
        return p

    def stacked(
        self, cores: list[dict[str, torch.Tensor]], names: list[str], model: TunedModel
    ) -> dict[str, torch.Tensor]:
        """Each tensor's N cores stacked in client order, on the model's device and dtype."""
        params = model.parameters_named(names)
        return {
            n: torch.stack([c[n].to(params[n].device, params[n].dtype) for c in cores])
            for n in names
        }

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """theta_i and p_i by the run's optimizer on the loss of w_i plus the scheduled
        proximal term; keep p_i, send theta_i."""
        model = runtime.model()
        names = runtime.split(model)[0]  # the core: every trainable tensor this client owns
        me = runtime.identity.client_id
        cores = received_cores(received, names, me)
        model.load_tensors(cores[me])
        own = model.parameters_named(names)
        device = next(iter(own.values())).device
        # theta_j for j != i, row i zero: w_i = p_ii theta_i + sum_j p_ij rest_j.
        rest = self.stacked(cores, names, model)
        for rows in rest.values():
            rows[me].zero_()
        anchor = initial_p(len(cores)).to(device)
        start = self.relationships(runtime, len(cores), {"before": server_round})
        p = start.to(device).clone().requires_grad_()
        config = runtime.config
        settings = config.settings_of(AppleSettings)
        coef = settings.proximal_weight(server_round, config.num_server_rounds) * settings.mu / 2
        optimizer = make_optimizer(
            [
                {"params": list(own.values())},
                {"params": [p], "lr": settings.p_lr, "weight_decay": 0.0},
            ],
            config,
        )

        def step(batch: Batch) -> list[StepResult]:
            optimizer.zero_grad(set_to_none=True)
            mixed = mixture(p, rest)
            w = {n: mixed[n] + p[me].to(own[n].dtype) * own[n] for n in names}
            result = runtime.task.step(WithTensors(model, w), batch)
            (result.loss + coef * ((p - anchor) ** 2).sum()).backward()
            optimizer.step()
            return [result]

        stats = local_schedule(runtime, model, own.values(), step, server_round)
        runtime.store.save(server_round, {P_KEY: p.detach()})
        return {n: t.detach().cpu().clone() for n, t in own.items()}, stats

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Evaluate w_i of the received cores and the latest p_i (p_0 when none is kept)."""
        model = runtime.model()
        names = runtime.split(model)[0]
        cores = received_cores(received, names, runtime.identity.client_id)
        p = self.relationships(runtime, len(cores), {"at_most": server_round})
        stacked = self.stacked(cores, names, model)
        device = next(iter(stacked.values())).device
        with torch.no_grad():
            model.load_tensors(mixture(p.to(device), stacked))
        return runtime.evaluate(model)
