"""PeFLL (Scott et al. 2024) in its one-message schedule: the embedding network against a hand
LeNet, the payload's theta and Jacobian against autograd, the server step against a plain-torch
vector-Jacobian product and Adam, the client's half of the backward pass against the whole
chain rule computed here, state, settings, and a run end to end."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import TensorDataset

from client_apps.pefll import DESCRIPTOR_SALT, PeFLLClient
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.learners import pefll as L
from fedfm_flower.learners.embedding_network import EmbeddingNetwork
from fedfm_flower.methods.pefll import IMAGE_CHANNELS, PeFLLSettings, embedding_parameters
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.registry import method_spec
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.models.groups import GroupPattern, TunedModel
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import numpy_arrays
from fedfm_flower.tasks.classification import ImageClassification
from server_apps.inprocess import run_in_process
from tests.tiny_clients import client_runtime, hand_adam

CLASSES, SIDE, N, DIM = 3, 8, 3, 2


class ImageModel(TunedModel):
    """logits = head(tanh(body(flattened image))): body is the ``adapter``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(3 * SIDE * SIDE, 4)
        self.head = nn.Linear(4, CLASSES)
        self.group_patterns = (
            GroupPattern("adapter", r"^body\."),
            GroupPattern("head", r"^head\."),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x.flatten(1))))


def images(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, SIDE, SIDE, generator=generator)
    return TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=generator))


def settings(**changes: object) -> PeFLLSettings:
    return PeFLLSettings(embedding_dim=DIM, hidden=6, layers=2, kernels=2, **changes)


def adapter() -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in ImageModel().trainable().tensors.items() if "body" in n}


def make_server(lr: float = 0.01, clip: float = 0.0) -> L.PeFLLServer:
    return L.PeFLLServer(settings(lr=lr, clip=clip), adapter(), N, CLASSES, seed=0)


def deltas(seed: int, clients) -> dict[int, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + seed)
    shapes = {n: t.shape for n, t in adapter().items()}
    return {
        c: {n: torch.randn(s, generator=generator) * 0.05 for n, s in shapes.items()}
        for c in clients
    }


def descriptors(seed: int, clients) -> dict[int, torch.Tensor]:
    generator = torch.Generator().manual_seed(200 + seed)
    return {c: torch.randn(DIM, generator=generator) * 0.3 + 0.1 for c in clients}


def psi_grads(seed: int, server: L.PeFLLServer, clients) -> dict[int, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(300 + seed)
    return {
        c: {
            n: torch.randn(p.shape, generator=generator) * 0.01
            for n, p in server.embedding.named_parameters()
        }
        for c in clients
    }


# ----------------------------------------------------------------------------- the networks
@pytest.mark.parametrize("labels", [True, False])
def test_the_descriptor_is_the_mean_of_a_hand_written_lenet(labels: bool) -> None:
    torch.manual_seed(1)
    network = EmbeddingNetwork(3, CLASSES, DIM, kernels=2, labels=labels)
    w = dict(network.named_parameters())
    data = images(10, 4)
    batches = [
        (data.tensors[0][:6], data.tensors[1][:6]),
        (data.tensors[0][6:], data.tensors[1][6:]),
    ]
    outputs = []
    for x, y in batches:
        x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
        if labels:
            planes = torch.zeros(len(y), CLASSES, 32, 32)
            planes[torch.arange(len(y)), y] = 1.0
            x = torch.cat([x, planes], 1)
        h = F.max_pool2d(torch.relu(F.conv2d(x, w["conv1.weight"], w["conv1.bias"])), 2)
        h = F.max_pool2d(torch.relu(F.conv2d(h, w["conv2.weight"], w["conv2.bias"])), 2)
        h = torch.relu(h.flatten(1) @ w["fc1.weight"].T + w["fc1.bias"])
        h = torch.relu(h @ w["fc2.weight"].T + w["fc2.bias"])
        outputs.append(h @ w["fc3.weight"].T + w["fc3.bias"])
    want = torch.cat(outputs).mean(0)
    torch.testing.assert_close(network.describe(batches, None), want, rtol=1e-5, atol=1e-6)
    assert network.conv2.out_channels == 4 and network.dim == DIM  # twice the kernels


def test_the_payload_is_h_of_the_normalized_descriptor_with_its_jacobian() -> None:
    server = make_server()
    first = server.payload(1)  # no descriptor yet: LoRA's init, no Jacobian, round 0
    assert all(torch.equal(first[n], t) for n, t in adapter().items())
    assert not any(n.startswith(L.JACOBIAN) for n in first) and int(first[L.DESCRIPTOR_ROUND]) == 0
    psi = {n: p.detach() for n, p in server.embedding.named_parameters()}
    assert all(torch.equal(first[L.EMBEDDING + n], t) for n, t in psi.items())
    reported = descriptors(0, [0, 1])
    server.step(1, deltas(0, [0, 1]), reported, {})
    server.step(2, deltas(1, [0]), descriptors(1, [0]), {})  # m and s stay the first round's
    values = torch.cat([reported[0], reported[1]])
    shift, scale, fixed = server.normalization.tolist()
    assert (shift, fixed) == (pytest.approx(float(values.mean())), 1.0)
    assert scale == pytest.approx(float(values.std()))
    got = server.payload(1)
    assert int(got[L.DESCRIPTOR_ROUND]) == 1

    def h_of_raw(v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = server.hypernetwork((v - shift) / scale)
        return tuple(out[n] for n in adapter())

    want = h_of_raw(reported[1])
    jacobian = torch.autograd.functional.jacobian(h_of_raw, reported[1])
    for index, name in enumerate(adapter()):
        torch.testing.assert_close(got[name], want[index].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[L.JACOBIAN + name], jacobian[index], rtol=1e-4, atol=1e-6)
    assert not torch.allclose(got["body.weight"], server.payload(0)["body.weight"])


@pytest.mark.parametrize("clip", [0.0, 0.02])
def test_a_server_step_is_the_hand_vjp_mean_of_psi_gradients_and_adam(clip: float) -> None:
    lr = 0.01
    server = make_server(lr, clip)
    server.step(1, deltas(0, range(N)), descriptors(0, range(N)), {})
    server.step(2, deltas(1, [0, 2]), descriptors(1, [0, 2]), psi_grads(1, server, [0, 2]))
    updates, grads = deltas(2, [0, 1, 2]), psi_grads(2, server, [0, 2])  # client 1: no psi grad
    used = {c: server.normalized_descriptor(c) for c in updates}
    phi = dict(server.hypernetwork.named_parameters())
    leaves = {n: p.detach().clone().requires_grad_() for n, p in phi.items()}
    want_grad = {n: torch.zeros_like(p) for n, p in phi.items()}
    for client, update in updates.items():
        generated = torch.func.functional_call(server.hypernetwork, leaves, (used[client],))
        names = list(update)
        vjp = torch.autograd.grad(
            [generated[n] for n in names],
            list(leaves.values()),
            grad_outputs=[-update[n] for n in names],
        )
        for name, g in zip(leaves, vjp, strict=True):
            want_grad[name] += g / 3
    psi = dict(server.embedding.named_parameters())
    for name in psi:
        # the mean over the two clients that sent one (client 1 sent none): not over all three
        want_grad["psi." + name] = (grads[0][name] + grads[2][name]) / 2
    norm = torch.stack([g.norm() for g in want_grad.values()]).norm()
    scale = min(1.0, clip / (float(norm) + 1e-6)) if clip else 1.0
    state = server.optimizer.state
    want = {
        n: hand_adam(p.detach(), want_grad[n] * scale, state.get(p, {}), lr) for n, p in phi.items()
    }
    want.update(
        {
            "psi." + n: hand_adam(p.detach(), want_grad["psi." + n] * scale, state.get(p, {}), lr)
            for n, p in psi.items()
        }
    )
    new = descriptors(2, [0, 1, 2])
    metrics = server.step(3, updates, new, grads)
    for name, p in phi.items():
        torch.testing.assert_close(p.detach(), want[name], rtol=1e-5, atol=1e-6, msg=name)
    for name, p in psi.items():
        torch.testing.assert_close(p.detach(), want["psi." + name], rtol=1e-5, atol=1e-6, msg=name)
    assert metrics["pefll-grad-norm"] == pytest.approx(float(norm), rel=1e-4)
    assert metrics["pefll-embedding-gradients"] == 2.0
    assert all(torch.equal(server.descriptors[c], new[c]) for c in new)
    assert server.descriptor_rounds.tolist() == [3, 3, 3]


def test_without_psi_gradients_psi_does_not_move_and_resume_is_exact(tmp_path: Path) -> None:
    server = make_server()
    before = [p.detach().clone() for p in server.embedding.parameters()]
    server.step(1, deltas(0, range(N)), descriptors(0, range(N)), {})
    assert all(
        torch.equal(a, b) for a, b in zip(before, server.embedding.parameters(), strict=True)
    )

    def schedule(s: L.PeFLLServer, rounds) -> None:
        for t in rounds:
            clients = [c for c in range(N) if (c + t) % 3]
            s.step(t, deltas(t, clients), descriptors(t, clients), psi_grads(t, s, clients[:1]))

    full = make_server(clip=0.05)
    schedule(full, range(1, 6))
    first = make_server(clip=0.05)
    schedule(first, range(1, 3))
    save_file(first.state_tensors(), str(tmp_path / "s.safetensors"))
    resumed = make_server(clip=0.05)
    resumed.load_state_tensors(load_file(str(tmp_path / "s.safetensors")))
    schedule(resumed, range(3, 6))
    a, b = full.state_tensors(), resumed.state_tensors()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_settings_spec_and_refusals() -> None:
    assert PeFLLSettings.keys() == (
        "pefll-lr",
        "pefll-embedding-dim",
        "pefll-hidden",
        "pefll-layers",
        "pefll-kernels",
        "pefll-embed-labels",
        "pefll-embed-batches",
        "pefll-clip",
        "pefll-head",
    )
    with pytest.raises(ConfigError, match="'pefll-kernels' = 0 is invalid: must be > 0"):
        ExperimentConfig.from_run_config({"method": "pefll", "pefll-kernels": 0})
    with pytest.raises(ConfigError, match="'pefll-head' = 'both' is invalid: allowed: local"):
        PeFLLSettings(head="both")
    with pytest.raises(ConfigError, match="'pefll-embed-batches' = -1"):
        ExperimentConfig().replace(pefll_embed_batches=-1)
    spec = method_spec("pefll")
    assert spec.modalities == ("image",) and spec.search == {"pefll-lr": LogUniform(1e-4, 1e-2)}
    caps = spec.capabilities
    assert caps.secagg and caps.central_dp and caps.local_dp  # every reply is read alone
    assert L.PeFLLServer(PeFLLSettings(), adapter(), 10, CLASSES).embedding.dim == 3  # 1 + N/4


# ----------------------------------------------------------------------------- the client
def image_runtime(tmp_path: Path):  # noqa: ANN201
    config = ExperimentConfig(method="pefll").replace(
        lr=0.1,
        batch_size=5,
        momentum=0.0,
        local_epochs=1,
        pefll_embedding_dim=DIM,
        pefll_hidden=6,
        pefll_layers=2,
        pefll_kernels=2,
        pefll_embed_batches=2,
    )
    runtime = client_runtime(ImageModel(), config, tmp_path, train=images(12, 1))
    runtime.__dict__["data"] = SimpleNamespace(
        train=images(12, 1), test=images(7, 2), num_classes=CLASSES
    )
    return runtime


def hand_descriptor(network: EmbeddingNetwork, runtime, server_round: int) -> torch.Tensor:
    """E averaged over the first 2 batches of the round's seeded order, by hand."""
    generator = torch.Generator().manual_seed(runtime.seed(server_round, salt=DESCRIPTOR_SALT))
    batches = list(ImageClassification().batches(runtime.data.train, 5, generator))[:2]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    return network(x, y).mean(0)


def test_the_clients_backward_half_is_the_whole_chain_rule(tmp_path: Path) -> None:
    runtime = image_runtime(tmp_path)
    server = L.PeFLLServer(runtime.config.settings_of(PeFLLSettings), adapter(), N, CLASSES, seed=0)
    client = PeFLLClient()
    sent, _ = client.train(runtime, server.payload(0), 1)
    assert float(sent[L.HAS_GRADIENT][0]) == 0.0  # a first participation: no Jacobian
    assert all(not g.any() for n, g in sent.items() if n.startswith(L.EMBEDDING_GRAD))
    psi1 = {n: p.detach().clone() for n, p in server.embedding.named_parameters()}
    network = EmbeddingNetwork(3, CLASSES, DIM, kernels=2)
    network.load_state_dict(psi1)
    torch.testing.assert_close(sent[L.DESCRIPTOR], hand_descriptor(network, runtime, 1).detach())
    grads = {
        n[len(L.EMBEDDING_GRAD) :]: t for n, t in sent.items() if n.startswith(L.EMBEDDING_GRAD)
    }
    moved = psi_grads(9, server, [0])  # psi moves: round 2 brings a psi other than psi1
    server.step(1, {0: {n: sent[n] for n in adapter()}}, {0: sent[L.DESCRIPTOR]}, moved)

    # Round 2: theta from the round-1 descriptor; the client's psi gradient must be
    # d/d psi1 of -<h((E(B1; psi1) - m) / s), Delta>, Delta its own update, h the payload's phi.
    payload = server.payload(0)
    phi = {n: p.detach().clone() for n, p in server.hypernetwork.named_parameters()}
    shift, scale, _ = server.normalization.tolist()
    assert not torch.equal(payload[L.EMBEDDING + "fc3.weight"], psi1["fc3.weight"])
    sent, _ = client.train(runtime, payload, 2)
    assert float(sent[L.HAS_GRADIENT][0]) == 1.0
    leaves = {n: t.clone().requires_grad_() for n, t in psi1.items()}
    descriptor = hand_descriptor_with(network, leaves, runtime, 1)
    theta = torch.func.functional_call(server.hypernetwork, phi, ((descriptor - shift) / scale,))
    surrogate = -sum((theta[n] * sent[n]).sum() for n in adapter())
    want = torch.autograd.grad(surrogate, list(leaves.values()))
    for name, g in zip(leaves, want, strict=True):
        torch.testing.assert_close(sent[L.EMBEDDING_GRAD + name], g, rtol=1e-4, atol=1e-7, msg=name)
    assert any(sent[L.EMBEDDING_GRAD + n].abs().sum() > 0 for n in leaves)
    # The new descriptor is E of round 2's batches with the psi just received.
    network.load_state_dict(
        {n[len(L.EMBEDDING) :]: t for n, t in payload.items() if n.startswith(L.EMBEDDING)}
    )
    torch.testing.assert_close(sent[L.DESCRIPTOR], hand_descriptor(network, runtime, 2).detach())
    # A message generated from another round's descriptor gets no (wrong) gradient.
    stale = {**server.payload(0), L.DESCRIPTOR_ROUND: torch.tensor([1])}
    sent, _ = client.train(runtime, stale, 3)  # the kept state is round 2's
    assert float(sent[L.HAS_GRADIENT][0]) == 0.0
    assert grads.keys() == {n for n, _ in network.named_parameters()}


def hand_descriptor_with(network, params, runtime, server_round: int) -> torch.Tensor:  # noqa: ANN001
    """``hand_descriptor`` with ``network``'s parameters replaced by ``params`` (leaves)."""
    generator = torch.Generator().manual_seed(runtime.seed(server_round, salt=DESCRIPTOR_SALT))
    batches = list(ImageClassification().batches(runtime.data.train, 5, generator))[:2]
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    return torch.func.functional_call(network, params, (x, y)).mean(0)


def test_the_head_stays_and_evaluation_uses_the_received_theta(tmp_path: Path) -> None:
    runtime = image_runtime(tmp_path)
    server = L.PeFLLServer(runtime.config.settings_of(PeFLLSettings), adapter(), N, CLASSES, seed=0)
    sent, _ = PeFLLClient().train(runtime, server.payload(0), 1)
    assert set(n for n in sent if not n.startswith("pefll.")) == {"body.weight", "body.bias"}
    kept = runtime.store.load(before=2)
    assert {"head.weight", "head.bias"} <= set(kept) and int(kept["pefll.kept-round"][0]) == 1
    seen = {}
    original = runtime.evaluate

    def evaluate(model):  # noqa: ANN001, ANN202
        seen.update(model.trainable().tensors)
        return original(model)

    runtime.evaluate = evaluate
    payload = server.payload(2)
    PeFLLClient().evaluate(runtime, payload, 1)
    assert torch.equal(seen["body.weight"], payload["body.weight"])
    assert torch.equal(seen["head.weight"], kept["head.weight"])


# ----------------------------------------------------------------------------- end to end
def test_a_run_exchanges_descriptors_jacobians_and_gradients(small_run_config: dict) -> None:
    replies: list[tuple[int, int, dict]] = []

    def keep(client_id: int, reply):  # noqa: ANN001, ANN202
        if reply.metadata.message_type == "train" and P.ARRAYS in reply.content.array_records:
            arrays = numpy_arrays(reply.content.array_records[P.ARRAYS])
            replies.append((int(reply.metadata.group_id), client_id, arrays))
        return reply

    config = {**small_run_config, "method": "pefll", "pefll-lr": 0.01}
    summary, grid = run_in_process(config, num_nodes=4, reply_hook=keep)
    assert summary["rounds"] == 2 and 0.2 < summary["final-test-accuracy-mean"] <= 1.0
    sent = {}
    for message in grid.sent:
        if message.metadata.message_type == "train":
            record = message.content[P.CONFIG]
            key = (int(record[P.SERVER_ROUND]), int(record[P.CLIENT_ID]))
            sent[key] = numpy_arrays(message.content.array_records[P.ARRAYS])
    assert len(sent) == 8 and len(replies) == 8
    lora = {n for n in sent[(1, 0)] if not n.startswith("pefll.")}
    assert lora and all("lora" in n for n in lora)  # the adapter, never a head
    for (rnd, _), arrays in sent.items():
        jacobians = {n for n in arrays if n.startswith(L.JACOBIAN)}
        assert int(arrays[L.DESCRIPTOR_ROUND][0]) == rnd - 1
        assert jacobians == (set() if rnd == 1 else {L.JACOBIAN + n for n in lora})
        psi = {n: a for n, a in arrays.items() if n.startswith(L.EMBEDDING)}
        assert psi and all((psi[n] == sent[(rnd, 0)][n]).all() for n in psi)  # one psi for all
    assert any((sent[(2, 1)][n] != sent[(2, 0)][n]).any() for n in lora)  # personalized
    for rnd, _, arrays in replies:
        assert float(arrays[L.HAS_GRADIENT][0]) == (rnd == 2)
        assert arrays[L.DESCRIPTOR].shape == (2,)  # int(1 + 4 / 4)


@pytest.mark.parametrize(
    ("kernels", "labels", "classes", "dim"),
    [(16, True, 10, 3), (8, False, 100, 5), (4, True, 2, 1)],
)
def test_the_resources_count_the_embedding_network_without_torch(
    kernels: int, labels: bool, classes: int, dim: int
) -> None:
    settings = PeFLLSettings(kernels=kernels, embed_labels=labels)
    network = EmbeddingNetwork(IMAGE_CHANNELS, classes, dim, kernels, labels)
    counted = embedding_parameters(settings, classes, dim)
    assert counted == sum(p.numel() for p in network.parameters())
