"""pFedHN (Shamsian et al. 2021): the hypernetwork and its server step against a plain-torch
vector-Jacobian product and Adam written here, the client's update against a hand loop, each
client's generated tensors reaching that client only, state, settings, and a run end to end."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from safetensors.torch import load_file, save_file

from client_apps.updates import UpdateClient
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.learners.pfedhn import PFedHNServer
from fedfm_flower.methods.pfedhn import PFedHNSettings
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.registry import method_spec, resolve
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.models import TrainableTensors
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import from_array_record, numpy_arrays
from fedfm_flower.tasks.classification import ImageClassification
from server_apps.inprocess import InProcessGrid, identity_app, run_in_process
from tests.tiny_clients import (
    TwoLayerModel,
    client_runtime,
    data,
    hand_adam,
    offset,
    two_layer_grads,
)

N, DIM, HIDDEN, LAYERS = 3, 2, 5, 3
SHAPES = {"a": (3, 2), "b": (4,)}


def initial() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {n: torch.randn(s, generator=generator) * 0.2 for n, s in SHAPES.items()}


def make_server(lr: float = 0.01, clip: float = 0.0) -> PFedHNServer:
    settings = PFedHNSettings(lr=lr, embedding_dim=DIM, hidden=HIDDEN, layers=LAYERS, clip=clip)
    return PFedHNServer(settings, initial(), N, seed=0)


def deltas(seed: int, clients) -> dict[int, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + seed)
    return {
        c: {n: torch.randn(s, generator=generator) * 0.05 for n, s in SHAPES.items()}
        for c in clients
    }


def warmed(lr: float = 0.01, clip: float = 0.0) -> PFedHNServer:
    """A server after two steps: Adam has state, the output layers are no longer zero."""
    server = make_server(lr, clip)
    server.step(deltas(0, range(N)))
    server.step(deltas(1, [0, 2]))
    return server


# ----------------------------------------------------------------------------- by hand
def hand_generate(p: dict[str, torch.Tensor], client: int) -> dict[str, torch.Tensor]:
    """h(v_client) from the parameters by name: Linear layers with ReLU between them, then one
    Linear per generated tensor."""
    x = p[f"descriptors.{client}"]
    for layer in range(LAYERS):
        if layer:
            x = torch.relu(x)
        index = 2 * layer
        x = x @ p[f"hypernetwork.trunk.{index}.weight"].T + p[f"hypernetwork.trunk.{index}.bias"]
    return {
        n: (p[f"hypernetwork.heads.{i}.weight"] @ x + p[f"hypernetwork.heads.{i}.bias"]).reshape(s)
        for i, (n, s) in enumerate(SHAPES.items())
    }


def named_parameters(server: PFedHNServer) -> dict[str, torch.nn.Parameter]:
    return {
        **{f"hypernetwork.{n}": p for n, p in server.hypernetwork.named_parameters()},
        **{f"descriptors.{i}": p for i, p in enumerate(server.descriptors)},
    }


def hand_step(
    server: PFedHNServer, updates: dict[int, dict[str, torch.Tensor]], lr: float, clip: float
) -> dict[str, torch.Tensor]:
    """The parameters after one step, computed from the server's parameters and Adam state with
    torch.autograd.grad's vector-Jacobian products, the clip and Adam written out."""
    params = named_parameters(server)
    leaves = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    grads: dict[str, torch.Tensor] = {}
    for client, update in updates.items():
        theta = hand_generate(leaves, client)
        proxy = [-update[n] for n in SHAPES]  # theta - theta~
        inputs = [
            n for n in leaves if not n.startswith("descriptors.") or n == f"descriptors.{client}"
        ]
        vjp = torch.autograd.grad(
            [theta[n] for n in SHAPES], [leaves[n] for n in inputs], grad_outputs=proxy
        )
        for name, g in zip(inputs, vjp, strict=True):
            grads[name] = grads.get(name, 0) + g / len(updates)
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    state = server.optimizer.state
    after = {n: p.detach().clone() for n, p in params.items()}
    for name, g in grads.items():
        after[name] = hand_adam(after[name], g * scale, state.get(params[name], {}), lr)
    return after


# ----------------------------------------------------------------------------- the hypernetwork
def test_every_client_starts_at_the_tuners_initial_tensors_and_the_mlp_is_the_hand_one() -> None:
    server = make_server()
    for client in range(N):
        got = server.generated_for(client)
        assert all(torch.equal(got[n], initial()[n]) for n in SHAPES)
    server = warmed()
    params = {n: p.detach() for n, p in named_parameters(server).items()}
    assert server.hypernetwork.descriptor_dim == DIM
    for client in range(N):
        got, want = server.generated_for(client), hand_generate(params, client)
        assert all(torch.allclose(got[n], want[n], atol=1e-6) for n in SHAPES)
    assert not torch.allclose(server.generated_for(0)["a"], server.generated_for(1)["a"])


@pytest.mark.parametrize("clip", [0.0, 0.05])
@pytest.mark.parametrize("reporting", [[1], [0, 2]])
def test_a_server_step_is_the_hand_vjp_and_adam_step(clip: float, reporting: list[int]) -> None:
    lr = 0.01
    server = warmed(lr, clip)
    updates = deltas(7, reporting)
    want = hand_step(server, updates, lr, clip)
    metrics = server.step(updates)
    got = {n: p.detach() for n, p in named_parameters(server).items()}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    if clip:  # the clip binds: the norm before clipping is reported
        assert metrics["pfedhn-grad-norm"] > clip
    assert metrics["pfedhn-round"] == 3.0


def test_non_reporting_descriptors_stay_and_a_small_step_moves_theta_towards_the_update() -> None:
    server = warmed(lr=1e-4)
    before = {c: server.generated_for(c) for c in range(N)}
    descriptors = [d.detach().clone() for d in server.descriptors]
    updates = deltas(9, [0, 2])
    server.step(updates)
    assert torch.equal(server.descriptors[1], descriptors[1])  # it has Adam momentum, yet stays
    assert not torch.equal(server.descriptors[0], descriptors[0])
    for client, update in updates.items():
        after = server.generated_for(client)
        gain = sum(float(((after[n] - before[client][n]) * update[n]).sum()) for n in SHAPES)
        assert gain > 0, client


def test_checkpoint_and_resume_are_exact(tmp_path: Path) -> None:
    schedule = [deltas(t, [c for c in range(N) if (c + t) % 3]) for t in range(6)]
    full = make_server(clip=0.1)
    for updates in schedule:
        full.step(updates)
    first = make_server(clip=0.1)
    for updates in schedule[:3]:
        first.step(updates)
    save_file(first.state_tensors(), str(tmp_path / "s.safetensors"))
    resumed = make_server(clip=0.1)
    resumed.load_state_tensors(load_file(str(tmp_path / "s.safetensors")))
    for updates in schedule[3:]:
        resumed.step(updates)
    a, b = full.state_tensors(), resumed.state_tensors()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_settings_split_spec_and_refusals() -> None:
    assert PFedHNSettings.keys() == (
        "pfedhn-lr",
        "pfedhn-embedding-dim",
        "pfedhn-hidden",
        "pfedhn-layers",
        "pfedhn-clip",
        "pfedhn-head",
    )
    with pytest.raises(ConfigError, match="'pfedhn-head' = 'shared' is invalid: allowed: local"):
        ExperimentConfig.from_run_config({"method": "pfedhn", "pfedhn-head": "shared"})
    with pytest.raises(ConfigError, match="'pfedhn-lr' = 0.0 is invalid: must be > 0"):
        PFedHNSettings(lr=0.0)
    with pytest.raises(ConfigError, match="'pfedhn-layers' = 0"):
        ExperimentConfig().replace(pfedhn_layers=0)
    with pytest.raises(ValueError, match="client-id 5 is outside"):
        make_server().generated_for(5)
    spec = method_spec("pfedhn")
    assert spec.client == "client_apps.updates:UpdateClient" and spec.tuner == "lora"
    assert spec.search == {"pfedhn-lr": LogUniform(1e-4, 1e-2)}  # pFedSeq's grid ends
    assert spec.capabilities.secagg and spec.capabilities.central_dp
    assert spec.capabilities.local_dp is None
    local = resolve(ExperimentConfig(method="pfedhn")).split
    generated = resolve(ExperimentConfig(method="pfedhn").replace(pfedhn_head="generated")).split
    assert (local.shared, local.local) == (("adapter",), ("head",))
    assert (generated.shared, generated.local) == (("adapter", "head"), ())
    server = PFedHNServer(PFedHNSettings(), initial(), 10)
    assert server.hypernetwork.descriptor_dim == 3  # the authors' int(1 + N / 4)


# ----------------------------------------------------------------------------- the client
def hand_local_training(
    start: dict[str, torch.Tensor], config: ExperimentConfig, seed: int
) -> dict[str, torch.Tensor]:
    """SGD with momentum written out, over the round's seeded batches of the 22 examples."""
    params = {n: t.clone() for n, t in start.items()}
    buffers: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(seed)
    names = list(params)
    for _ in range(config.local_epochs):
        for x, y in ImageClassification().batches(data(22, 1), config.batch_size, generator):
            for name, g in zip(names, two_layer_grads(params, x, y), strict=True):
                buffers[name] = config.momentum * buffers[name] + g if name in buffers else g
                params[name] = params[name] - config.lr * buffers[name]
    return params


@pytest.mark.parametrize("head", ["local", "generated"])
def test_the_client_trains_what_it_received_and_sends_the_change(head: str, tmp_path) -> None:
    config = ExperimentConfig(method="pfedhn").replace(
        pfedhn_head=head, lr=0.2, batch_size=8, momentum=0.5, local_epochs=2
    )
    model = TwoLayerModel(body_group="adapter")
    runtime = client_runtime(model, config, tmp_path)
    start = offset(model.trainable().tensors, 1, 0.3)  # generated body (and head), kept head
    runtime.store.save(1, {n: start[n] for n in ("head.weight", "head.bias")})
    shared = ["body.weight", "body.bias"] + (
        ["head.weight", "head.bias"] if head != "local" else []
    )
    received = {n: start[n].clone() for n in shared}
    sent, stats = UpdateClient().train(runtime, received, 2)
    want = hand_local_training(start, config, runtime.seed(2))
    assert list(sent) == shared  # the generated tensors' change only
    for name in shared:
        torch.testing.assert_close(sent[name], want[name] - start[name], rtol=0, atol=1e-6)
        assert torch.equal(received[name], start[name])  # theta_i itself untouched
    kept = runtime.store.load(before=3)
    if head == "local":  # the head trained jointly stays on the client
        assert all(
            torch.allclose(kept[n], want[n], atol=1e-6) for n in ("head.weight", "head.bias")
        )
    else:  # nothing is kept: the head came from the hypernetwork
        assert runtime.store.rounds() == [1]
    assert stats.num_steps == 6


# ----------------------------------------------------------------------------- the strategy
def tiny_strategy(config: ExperimentConfig):  # noqa: ANN201
    from strategies.pfedhn import PFedHNStrategy

    tensors = {"adapter.a": torch.zeros(4, 3), "adapter.b": torch.ones(2), "head.w": torch.zeros(2)}
    groups = {"adapter.a": "adapter", "adapter.b": "adapter", "head.w": "head"}
    grid = InProcessGrid(
        identity_app(), config.to_run_config(), [{"client-id": i} for i in range(3)]
    )
    return PFedHNStrategy(config, TrainableTensors(tensors, groups)), grid


def test_each_node_gets_its_own_clients_generated_tensors_only() -> None:
    config = ExperimentConfig(method="pfedhn", num_clients=3).replace(pfedhn_lr=0.05)
    strategy, grid = tiny_strategy(config)
    server = strategy.require_server()
    server.step(
        {
            c: {"adapter.a": torch.full((4, 3), 0.1 * (c + 1)), "adapter.b": -torch.ones(2)}
            for c in range(3)
        }
    )
    messages = list(strategy.configure_train(2, ArrayRecord(), ConfigRecord(), grid))
    node_client = strategy.nodes.node_to_client
    assert len(messages) == 3
    payloads = {}
    for message in messages:
        client = node_client[message.metadata.dst_node_id]
        assert int(message.content[P.CONFIG][P.CLIENT_ID]) == client
        payloads[client] = from_array_record(message.content[P.ARRAYS])
        want = server.generated_for(client)
        assert list(payloads[client]) == ["adapter.a", "adapter.b"]  # never the head
        assert all(torch.equal(payloads[client][n], want[n]) for n in want)
    assert not torch.equal(payloads[0]["adapter.a"], payloads[1]["adapter.a"])
    tensors, meta = strategy.state_dict()  # the whole server state round-trips
    restored, _ = tiny_strategy(config.replace(num_clients=0))
    restored.load_state_dict(tensors, meta)
    again = restored.state_dict()[0]
    assert set(again) == set(tensors) and all(torch.equal(again[k], tensors[k]) for k in tensors)
    with pytest.raises(ValueError, match="LoRA adapters"):
        from strategies.pfedhn import PFedHNStrategy

        PFedHNStrategy(config, TrainableTensors({"head.w": torch.zeros(2)}, {"head.w": "head"}))


# ----------------------------------------------------------------------------- end to end
def test_a_run_personalizes_the_adapters_and_keeps_the_heads(small_run_config: dict) -> None:
    replies: list[tuple[int, dict]] = []

    def keep(client_id: int, reply):  # noqa: ANN001, ANN202
        if reply.metadata.message_type == "train" and P.ARRAYS in reply.content.array_records:
            replies.append((client_id, numpy_arrays(reply.content.array_records[P.ARRAYS])))
        return reply

    config = {**small_run_config, "method": "pfedhn", "pfedhn-lr": 0.01}
    summary, grid = run_in_process(config, num_nodes=4, reply_hook=keep)
    assert summary["rounds"] == 2 and len(summary["final-per-client-accuracy"]) == 4
    assert 0.2 < summary["final-test-accuracy-mean"] <= 1.0  # chance is 0.1
    sent = {}
    for message in grid.sent:
        if message.metadata.message_type == "train":
            record = message.content[P.CONFIG]
            key = (int(record[P.SERVER_ROUND]), int(record[P.CLIENT_ID]))
            sent[key] = numpy_arrays(message.content.array_records[P.ARRAYS])
    assert len(sent) == 8 and len(replies) == 8
    names = set(sent[(1, 0)])
    assert names and all("lora" in n for n in names)  # the adapter only, never a head
    assert all(set(arrays) == names for arrays in sent.values())
    assert all(set(arrays) == names for _, arrays in replies)
    # Round 1: every client gets LoRA's initialization; round 2: each its own adapter.
    assert all((sent[(1, c)][n] == sent[(1, 0)][n]).all() for c in range(4) for n in names)
    assert all(any((sent[(2, c)][n] != sent[(2, 0)][n]).any() for n in names) for c in range(1, 4))
