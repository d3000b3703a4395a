"""pFedLA (Ma et al. 2022): the layer-wise mix against a hand computation, the hypernetwork step
against plain-torch autograd and a hand-written Adam, the stored models, the layers of the tiny
ViT, state save/restore, and a run end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.learners.pfedla import PFedLAServer, layer_groups
from fedfm_flower.methods.pfedla import PFedLASettings
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.registry import method_spec, split_parameters
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.models import TrainableTensors, initial_trainable
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import numpy_arrays
from fedfm_flower.records.results import RunDirectory
from server_apps.inprocess import run_in_process
from strategies.pfedla import PFedLAStrategy

N = 4
A0 = "backbone.blocks.0.attn.qkv.lora_A.default.weight"
B0 = "backbone.blocks.0.attn.qkv.lora_B.default.weight"
A1 = "backbone.blocks.1.attn.qkv.lora_A.default.weight"
B1 = "backbone.blocks.1.attn.qkv.lora_B.default.weight"
SHAPES = {A0: (2, 3), B0: (3, 2), A1: (2, 3), B1: (3, 2), "head.weight": (2, 3), "head.bias": (2,)}
GROUPS = {n: "head" if n.startswith("head.") else "adapter" for n in SHAPES}
NAMES = list(SHAPES)
# Written out by hand: block 0's LoRA factors, block 1's, the head.
LAYER = {A0: 0, B0: 0, A1: 1, B1: 1, "head.weight": 2, "head.bias": 2}
L = 3


def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(s, generator=g) * 0.3 for n, s in SHAPES.items()}


def settings(**changes: object) -> PFedLASettings:
    return PFedLASettings(embedding_dim=8, hidden=16, **changes)


def make_server(lr: float = 1e-2, **changes: object) -> PFedLAServer:
    return PFedLAServer(settings(lr=lr, **changes), initial(), GROUPS, N, seed=0)


def spread(server: PFedLAServer, seed: int = 7) -> None:
    """Distinct stored models theta_j (after round 1 they differ)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stacked in server.models.values():
            stacked.copy_(torch.randn(stacked.shape, generator=g))


def deltas(seed: int, clients) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + seed)
    return {c: {n: torch.randn(s, generator=g) * 0.1 for n, s in SHAPES.items()} for c in clients}


def hand_alpha(params: dict[str, torch.Tensor], client: int) -> torch.Tensor:
    """alpha_i by hand: embedding -> 3 x (Linear, ReLU) -> Linear, ReLU, each layer's row / sum
    (an all-zero row: weight 1 on the client itself)."""
    h = params["embedding"]
    for k in (0, 2, 4):
        h = torch.relu(params[f"mlp.{k}.weight"] @ h + params[f"mlp.{k}.bias"])
    raw = torch.relu(params["out.weight"] @ h + params["out.bias"]).reshape(L, N)
    rows = []
    for row in raw:
        if float(row.detach().sum()) == 0.0:
            rows.append(torch.nn.functional.one_hot(torch.tensor(client), N).to(raw.dtype))
        else:
            rows.append(row / row.sum())
    return torch.stack(rows)


def hand_mix(alpha: torch.Tensor, models: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """theta~^l = sum_j alpha^l_j theta_j^l, term by term."""
    return {n: sum(alpha[LAYER[n], j] * models[n][j] for j in range(N)) for n in NAMES}


def hn_params(server: PFedLAServer, client: int) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in server.hypernetworks[client].named_parameters()}


# ----------------------------------------------------------------------------- settings


def test_bad_settings_are_refused_naming_key_and_value() -> None:
    with pytest.raises(ConfigError, match="'pfedla-layers' = 'module' is invalid: allowed: block"):
        PFedLASettings(layers="module")
    with pytest.raises(ConfigError, match="'pfedla-lr' = 0.0 is invalid"):
        PFedLASettings(lr=0.0)
    with pytest.raises(ConfigError, match="'pfedla-hidden' = 0 is invalid"):
        ExperimentConfig.from_run_config({"method": "pfedla", "pfedla-hidden": 0})
    with pytest.raises(ConfigError, match="'pfedla-head' = 'shared' is invalid: allowed: mixed"):
        ExperimentConfig.from_run_config({"method": "pfedla", "pfedla-head": "shared"})
    with pytest.raises(ConfigError, match="'pfedla-embedding-dim'"):
        ExperimentConfig().replace(pfedla_embedding_dim=-1)
    # Each hypernetwork reads its own client's update: no SecAgg+, no central DP.
    with pytest.raises(ConfigError, match="'secagg' = True .* method 'pfedla' cannot take it"):
        ExperimentConfig.from_run_config({"method": "pfedla", "secagg": True}).validate()
    with pytest.raises(ConfigError, match="'dp' = 'central' .* method 'pfedla' cannot take it"):
        ExperimentConfig.from_run_config(
            {"method": "pfedla", "dp": "central", "dp-noise-multiplier": 1.0}
        ).validate()
    spec = method_spec("pfedla")
    assert spec.capabilities.refusal("local-dp") is None
    assert spec.client == "client_apps.updates:UpdateClient" and spec.tuner == "lora"
    assert spec.search == {"pfedla-lr": LogUniform(1e-4, 1e-2)}  # pFedSeq's grid ends


def test_layers_of_the_tiny_vit_are_its_blocks_and_the_head() -> None:
    config = ExperimentConfig(method="pfedla", pretrained=False)
    trainable = initial_trainable(config, "lora", 10)
    shared, local = split_parameters(config, trainable.groups)
    assert local == [] and shared == list(trainable.tensors)  # the head is mixed too
    blocks = layer_groups(shared, trainable.groups, "block")
    depth = len(blocks) - 1
    assert list(blocks) == [f"backbone.blocks.{k}" for k in range(depth)] + ["head"]
    for k in range(depth):
        lora = f"backbone.blocks.{k}.attn.qkv.lora_"
        assert blocks[f"backbone.blocks.{k}"] == [
            f"{lora}A.default.weight",
            f"{lora}B.default.weight",
        ]
    assert blocks["head"] == ["head.weight", "head.bias"]
    assert list(layer_groups(shared, trainable.groups, "tensor")) == shared
    # With the head kept local, the head is neither sent nor mixed.
    config = config.replace(pfedla_head="local")
    shared, local = split_parameters(config, trainable.groups)
    assert local == ["head.weight", "head.bias"]
    strategy = PFedLAStrategy(config.replace(num_clients=3), trainable)
    assert list(strategy.server.layers) == [f"backbone.blocks.{k}" for k in range(depth)]
    assert set(strategy.train_payload(1, 1)) == set(strategy.reply_spec(1)) == set(shared)


# ----------------------------------------------------------------------------- the mix


def test_each_client_gets_the_hand_computed_layer_wise_mix() -> None:
    server = make_server()
    spread(server)
    models = {n: t.double() for n, t in server.models.items()}
    mixes = []
    for client in range(N):
        params = {n: p.double() for n, p in hn_params(server, client).items()}
        alpha = hand_alpha(params, client)
        assert (alpha >= 0).all() and torch.allclose(alpha.sum(1), torch.ones(L, dtype=alpha.dtype))
        expected = hand_mix(alpha, models)
        got = server.model_for(client)
        for name in NAMES:
            torch.testing.assert_close(got[name].double(), expected[name], rtol=1e-5, atol=1e-6)
        mixes.append(got)
    assert not torch.allclose(mixes[0]["head.weight"], mixes[1]["head.weight"])  # personal
    # A layer whose weights are all 0 after the ReLU is the client's own model, bit for bit.
    with torch.no_grad():
        server.hypernetworks[1].out.bias[:N] = -1e4  # layer 0's N outputs
    got = server.model_for(1)
    assert torch.equal(got[A0], server.models[A0][1]) and torch.equal(got[B0], server.models[B0][1])
    assert not torch.equal(got[A1], server.models[A1][1])
    server.step(deltas(0, [1]))
    assert all(torch.isfinite(p).all() for p in server.hypernetworks[1].parameters())


def test_round_one_sends_the_initial_model_and_leaves_the_hypernetworks() -> None:
    server = make_server()
    before = [hn_params(server, c) for c in range(N)]
    for client in range(N):
        assert all(torch.equal(server.model_for(client)[n], initial()[n]) for n in NAMES)
    updates = deltas(1, [0, 2])
    server.step(updates)
    # Equal stored models: the mix does not depend on the weights, whose gradient is exactly 0.
    for client in range(N):
        after = hn_params(server, client)
        assert all(torch.equal(after[n], before[client][n]) for n in after)
    for name in NAMES:
        for client in range(N):
            expected = (
                initial()[name] + updates[client][name] if client in updates else initial()[name]
            )
            torch.testing.assert_close(server.models[name][client], expected, rtol=0, atol=1e-7)


# ----------------------------------------------------------------------------- the step


def test_the_step_is_the_chain_rule_by_autograd_with_adam_by_hand() -> None:
    lr, (beta1, beta2), eps = 1e-2, (0.9, 0.999), 1e-8
    server = make_server(lr=lr)
    spread(server)
    hand = {c: hn_params(server, c) for c in range(N)}
    models = {n: t.clone() for n, t in server.models.items()}
    moments = {c: {n: [0, 0.0, 0.0] for n in hand[c]} for c in range(N)}  # step, m, v
    for t, reporting in enumerate([[0, 2], [2, 3], [0, 1, 2, 3]]):
        updates = deltas(t, reporting)
        # By hand: S = -sum_i <theta~_i(v_i, phi_i), Delta_i>, its gradient by autograd ...
        leaves = {c: {n: p.clone().requires_grad_() for n, p in hand[c].items()} for c in reporting}
        surrogate, sent = torch.zeros(()), {}
        for c in reporting:
            mixed = hand_mix(hand_alpha(leaves[c], c), models)
            surrogate = surrogate - sum((mixed[n] * updates[c][n]).sum() for n in NAMES)
            sent[c] = {n: m.detach() for n, m in mixed.items()}
        order = [(c, n) for c in reporting for n in leaves[c]]
        grads = torch.autograd.grad(surrogate, [leaves[c][n] for c, n in order])
        # ... and Adam (bias-corrected moments), for the reporting clients' parameters only.
        for (c, n), g in zip(order, grads, strict=True):
            state = moments[c][n]
            state[0] += 1
            state[1] = beta1 * state[1] + (1 - beta1) * g
            state[2] = beta2 * state[2] + (1 - beta2) * g * g
            m_hat = state[1] / (1 - beta1 ** state[0])
            v_hat = state[2] / (1 - beta2 ** state[0])
            hand[c][n] = hand[c][n] - lr * m_hat / (v_hat.sqrt() + eps)
        for c in reporting:  # theta_i <- theta~_i + Delta theta_i
            for n in NAMES:
                models[n][c] = sent[c][n] + updates[c][n]
        quiet = {c: hn_params(server, c) for c in range(N) if c not in reporting}
        server.step(updates)
        for c in range(N):
            got = hn_params(server, c)
            for n in got:
                if c in quiet:  # no gradient: Adam leaves it bit for bit, momentum or not
                    assert torch.equal(got[n], quiet[c][n]), (t, c, n)
                torch.testing.assert_close(got[n], hand[c][n], rtol=1e-5, atol=1e-6)
        for n in NAMES:
            torch.testing.assert_close(server.models[n], models[n], rtol=1e-5, atol=1e-6)


def test_a_small_step_moves_each_mix_towards_the_trained_model() -> None:
    server = make_server(lr=1e-4)
    spread(server)
    for t in range(2):  # some Adam history
        server.step(deltas(t, range(N)))
    old = {n: t.clone() for n, t in server.models.items()}
    reporting = [1, 3]
    sent = {c: server.model_for(c) for c in reporting}
    updates = deltas(5, reporting)
    server.step(updates)
    for c in reporting:  # the new weights, mixing the models the step was taken on
        with torch.no_grad():
            moved = hand_mix(server.alpha(c), old)
        gain = sum(float(((moved[n] - sent[c][n]) * updates[c][n]).sum()) for n in NAMES)
        assert gain > 0, (c, gain)


def test_tensor_layers_give_every_tensor_its_own_weights() -> None:
    server = make_server(layers="tensor")
    assert list(server.layers) == NAMES and server.alpha(0).shape == (len(NAMES), N)
    assert server.hypernetworks[0].out.out_features == len(NAMES) * N


# ----------------------------------------------------------------------------- state


def test_checkpoint_and_resume_are_exact(tmp_path: Path) -> None:
    trainable = TrainableTensors(initial(), GROUPS)
    config = ExperimentConfig(method="pfedla").replace(
        pfedla_embedding_dim=8, pfedla_hidden=16, pfedla_lr=1e-2
    )

    def run(strategy: PFedLAStrategy, steps: range) -> None:
        for t in steps:
            strategy.server.step(deltas(t, [c for c in range(N) if (c + t) % 3]))

    full = PFedLAStrategy(config.replace(num_clients=N), trainable)
    run(full, range(5))
    first = PFedLAStrategy(config.replace(num_clients=N), trainable)
    run(first, range(2))
    tensors, meta = first.state_dict()
    save_file(tensors, str(tmp_path / "s.safetensors"))
    resumed = PFedLAStrategy(config, trainable)  # N unknown until the checkpoint says it
    assert resumed.server is None
    resumed.load_state_dict(load_file(str(tmp_path / "s.safetensors")), meta)
    assert resumed.server.num_clients == N and resumed.server.round == 2
    run(resumed, range(2, 5))
    a, b = full.state_tensors(), resumed.state_tensors()
    assert set(a) == set(b) and any(k.startswith("adam.") for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for client in range(N):
        assert all(
            torch.equal(full.train_payload(client, 6)[n], resumed.train_payload(client, 6)[n])
            for n in NAMES
        )


def test_a_client_id_outside_the_slots_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="client-id 9 is outside"):
        make_server().model_for(9)


# ----------------------------------------------------------------------------- end to end


def test_a_run_sends_each_client_its_mix_and_stores_its_trained_model(
    small_run_config: dict, tmp_path: Path
) -> None:
    replies: dict[tuple[int, int], dict] = {}

    def keep(client_id: int, reply):  # noqa: ANN001, ANN202
        if reply.metadata.message_type == "train" and P.ARRAYS in reply.content.array_records:
            arrays = numpy_arrays(reply.content.array_records[P.ARRAYS])
            replies[(int(reply.metadata.group_id), client_id)] = arrays
        return reply

    config = {**small_run_config, "method": "pfedla", "client-state-dir": str(tmp_path / "s")}
    summary, grid = run_in_process(config, num_nodes=N, reply_hook=keep)
    assert summary["rounds"] == 2 and len(summary["final-per-client-accuracy"]) == N
    assert 0.2 < summary["final-test-accuracy-mean"] <= 1.0  # chance is 0.1
    sent: dict[tuple[int, int], dict] = {}
    for message in grid.sent:
        if message.metadata.message_type == "train":
            node = grid.contexts[message.metadata.dst_node_id].node_config
            key = (int(message.metadata.group_id), int(node["partition-id"]))
            sent[key] = numpy_arrays(message.content.array_records[P.ARRAYS])
    assert set(sent) == set(replies) == {(r, c) for r in (1, 2) for c in range(N)}
    names = set(sent[(1, 0)])
    assert names and all(n.startswith(("backbone.blocks.", "head.")) for n in names)
    assert all("lora_" in n for n in names if n.startswith("backbone."))  # no frozen weight
    # Round 1: one model for all; round 2: each client its own mix.
    assert all((sent[(1, c)][n] == sent[(1, 0)][n]).all() for c in range(N) for n in names)
    assert not (sent[(2, 0)]["head.weight"] == sent[(2, 1)]["head.weight"]).all()
    # The checkpoint's stored model of client c is what c was sent plus what it sent back.
    tensors, _ = RunDirectory(Path(config["output-dir"]) / summary["run-name"]).load_checkpoint(2)
    for c in range(N):
        for n in names:
            stored = tensors[f"models.{n}"][c]
            expected = torch.from_numpy(sent[(2, c)][n] + replies[(2, c)][n])
            torch.testing.assert_close(stored, expected, rtol=1e-5, atol=1e-6)
