"""PeFLL's client (Scott et al. 2024), in the one-message schedule of
``fedfm_flower.methods.pefll``.

Round t's message holds theta_i (generated from the descriptor this client sent at its previous
participation t'), the embedding network psi^t, the round t' and the hypernetwork's Jacobian
d theta_i / d v_i. The client

1. trains theta_i with its head (pFedHN's client: ``UpdateClient``'s joint training) and takes
   Delta_i = theta_i~ - theta_i;
2. backpropagates the descriptor's gradient g_i = -(d theta_i / d v_i)^T Delta_i through the
   embedding network it kept from t' (psi^t'), on that round's descriptor batches (redrawn from
   round t''s seed): the psi gradient (d v_i / d psi)^T g_i. Without a Jacobian (a first
   participation) or a kept state of round t' (lost, or a reply the server did not take) it
   sends zeros and ``has-gradient`` 0;
3. computes its next descriptor v_i = E(B^t; psi^t) and keeps psi^t, with its head, for step 2
   of its next participation.

It replies with Delta_i, v_i, the psi gradient and the flag. Evaluation uses the received theta_i
and the kept head.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from client_apps.base import ClientRuntime
from client_apps.updates import UpdateClient
from fedfm_flower.learners import pefll as L
from fedfm_flower.learners.embedding_network import EmbeddingNetwork
from fedfm_flower.methods.pefll import PeFLLSettings
from fedfm_flower.tasks.training import EvalStats, TrainStats

KEPT = "pefll.kept."  # client state: psi of the round whose descriptor was sent
KEPT_ROUND = "pefll.kept-round"
DESCRIPTOR_SALT = 5  # the descriptor batches' seed: runtime.seed(round, salt=5)


def method_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of the model (theta_i, the head), without PeFLL's ``pefll.*`` entries."""
    return {n: t for n, t in tensors.items() if not n.startswith("pefll.")}


def descriptor_batches(runtime: ClientRuntime, server_round: int) -> Iterator[tuple]:
    """The batches client's descriptor of ``server_round`` averages over: the first
    ``pefll-embed-batches`` (0: all) of its training split in that round's seeded order."""
    count = runtime.config.settings_of(PeFLLSettings).embed_batches
    generator = torch.Generator().manual_seed(runtime.seed(server_round, salt=DESCRIPTOR_SALT))
    batches = runtime.task.batches(runtime.data.train, runtime.config.batch_size, generator)
    for index, batch in enumerate(batches):
        if count and index >= count:
            return
        yield batch


def embedding_network(
    runtime: ClientRuntime, tensors: dict[str, torch.Tensor], prefix: str
) -> EmbeddingNetwork:
    """E with the parameters ``tensors`` holds under ``prefix``, on the client's device."""
    settings = runtime.config.settings_of(PeFLLSettings)
    params = {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}
    classes = runtime.task.num_outputs(runtime.config, runtime.data)
    network = EmbeddingNetwork(
        params["conv1.weight"].shape[1] - (classes if settings.embed_labels else 0),
        classes,
        params["fc3.bias"].shape[0],
        settings.kernels,
        settings.embed_labels,
    )
    network.load_state_dict(params)
    return network.to(runtime.device)


def descriptor_gradient(
    jacobian: dict[str, torch.Tensor], update: dict[str, torch.Tensor]
) -> torch.Tensor:
    """g = -(d theta / d v)^T Delta: the descriptor's gradient of -<theta, Delta>."""
    total = None
    for name, delta in update.items():
        columns = jacobian[name].reshape(-1, jacobian[name].shape[-1])
        part = -(columns * delta.reshape(-1, 1).to(columns.dtype)).sum(0)
        total = part if total is None else total + part
    return total


class PeFLLClient(UpdateClient):
    """pFedHN's client plus the descriptor and the embedding network's backward pass."""

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """Train theta_i, backpropagate the last descriptor's gradient, describe anew."""
        generated = method_tensors(received)
        kept = runtime.store.load(before=server_round) or {}
        model = runtime.model()
        shared, local = self.split(runtime, model)
        if local:
            model.load_tensors({n: kept[n] for n in local if n in kept})
        model.load_tensors(generated)
        stats = self.local_training(runtime, model, generated, server_round)
        update = {n: t - generated[n].to(t.dtype) for n, t in model.tensors_named(shared).items()}
        gradient, has_gradient = self.embedding_gradient(runtime, received, kept, update)
        network = embedding_network(runtime, received, L.EMBEDDING)
        with torch.no_grad():
            descriptor = network.describe(descriptor_batches(runtime, server_round), runtime.device)
        runtime.store.save(
            server_round,
            {
                **model.tensors_named(local),
                **{KEPT + n: p.detach().cpu().clone() for n, p in network.named_parameters()},
                KEPT_ROUND: torch.tensor([server_round], dtype=torch.int64),
            },
        )
        sent = {
            **update,
            L.DESCRIPTOR: descriptor.detach().cpu(),
            **{L.EMBEDDING_GRAD + n: g for n, g in gradient.items()},
            L.HAS_GRADIENT: torch.tensor([float(has_gradient)]),
        }
        return sent, stats

    def embedding_gradient(
        self,
        runtime: ClientRuntime,
        received: dict[str, torch.Tensor],
        kept: dict[str, torch.Tensor],
        update: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """(d v / d psi)^T g at the kept psi and its round's batches, and True; zeros and False
        when there is no Jacobian or the kept state is not the round theta_i came from."""
        descriptor_round = int(received[L.DESCRIPTOR_ROUND][0])
        jacobian = {
            n[len(L.JACOBIAN) :]: t for n, t in received.items() if n.startswith(L.JACOBIAN)
        }
        usable = (
            bool(jacobian)
            and KEPT_ROUND in kept
            and int(kept[KEPT_ROUND][0]) == descriptor_round > 0
        )
        if not usable:
            zeros = embedding_network(runtime, received, L.EMBEDDING)
            return {n: torch.zeros_like(p).cpu() for n, p in zeros.named_parameters()}, False
        network = embedding_network(runtime, kept, KEPT)
        params = list(network.parameters())
        descriptor = network.describe(descriptor_batches(runtime, descriptor_round), runtime.device)
        g = descriptor_gradient(jacobian, update).to(descriptor.device, descriptor.dtype)
        grads = torch.autograd.grad(descriptor, params, grad_outputs=g)
        names = [n for n, _ in network.named_parameters()]
        return {n: gr.detach().cpu() for n, gr in zip(names, grads, strict=True)}, True

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """Evaluate the received theta_i with the kept head."""
        model = runtime.model()
        local = self.split(runtime, model)[1]
        if local:
            kept = runtime.store.load(at_most=server_round) or {}
            model.load_tensors({n: kept[n] for n in local if n in kept})
        model.load_tensors(method_tensors(received))
        return runtime.evaluate(model)
