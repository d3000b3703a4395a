"""pFedSeq: selective scan, sequential learners and the server step against independent math."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fedfm_flower.config import SCAN_BACKENDS, SEQ_LEARNERS, ConfigError, ExperimentConfig
from fedfm_flower.learners import selective_scan as scan
from fedfm_flower.learners.layout import ParameterLayout, layer_key
from fedfm_flower.learners.mamba import MambaMixer
from fedfm_flower.learners.pfedseq import PFedSeqServer, PFedSeqSettings
from fedfm_flower.learners.sequence import LEARNERS, LearnerSpec, SequenceLearner

N = 4
ADAPTER = {
    "backbone.blocks.0.attn.qkv.lora_A.default.weight": (2, 6),
    "backbone.blocks.0.attn.qkv.lora_B.default.weight": (9, 2),
    "backbone.blocks.1.attn.qkv.lora_A.default.weight": (2, 6),
    "backbone.blocks.1.attn.qkv.lora_B.default.weight": (9, 2),
}


def initial_adapter(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*shape, generator=g) * 0.1 for k, shape in ADAPTER.items()}


def make_server(**changes) -> PFedSeqServer:
    learner = dataclasses.replace(
        LearnerSpec(seq_len=changes.pop("seq_len", 5)), **changes.pop("spec", {})
    )
    settings = PFedSeqSettings(
        seq_len=learner.seq_len,
        warmup_rounds=changes.pop("warmup_rounds", 1),
        lr=changes.pop("lr", 1e-2),
        learner=learner,
        **changes,
    )
    return PFedSeqServer(settings, initial_adapter(), N, seed=0)


def random_updates(server: PFedSeqServer, seed: int, clients=range(N)) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return {c: torch.randn(server.layout.size, generator=g) * 1e-3 for c in clients}


def run_rounds(server: PFedSeqServer, rounds: range, clients=range(N)) -> None:
    for t in rounds:
        updates = random_updates(server, t, clients)
        server.step(updates, {c: 10 * (c + 1) for c in updates})


def randomize_output_projections(module: torch.nn.Module, seed: int = 0) -> None:
    """Zero-initialised outputs hide errors in everything before them; make them non-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "out_proj" in name or name.endswith("net.6.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


# ---------------------------------------------------------------- the selective scan
def naive_selective_scan(u, delta, A, B, C, D, z, delta_bias):
    """Mamba's recurrence written out channel by channel (zero initial state)."""
    batch, dim, steps = u.shape
    delta = F.softplus(delta + delta_bias[:, None])
    channels = []
    for d in range(dim):
        h = torch.zeros(batch, A.shape[1], dtype=u.dtype)
        ys = []
        for t in range(steps):
            decay = torch.exp(delta[:, d, t, None] * A[d])  # (batch, n)
            h = decay * h + delta[:, d, t, None] * B[:, :, t] * u[:, d, t, None]
            ys.append((h * C[:, :, t]).sum(-1) + D[d] * u[:, d, t])
        channels.append(torch.stack(ys, -1))
    return torch.stack(channels, 1) * z * torch.sigmoid(z)


def scan_inputs(seed: int = 0, batch: int = 3, dim: int = 5, n: int = 4, steps: int = 6):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(
        u=r(batch, dim, steps),
        delta=r(batch, dim, steps),
        A=-torch.rand(dim, n, generator=g, dtype=torch.float64) - 0.1,
        B=r(batch, n, steps),
        C=r(batch, n, steps),
        D=r(dim),
        z=r(batch, dim, steps),
        delta_bias=r(dim),
    )


def test_torch_selective_scan_matches_the_recurrence_values_and_gradients() -> None:
    inputs = {k: v.requires_grad_() for k, v in scan_inputs().items()}
    got = scan.selective_scan_torch(**inputs, delta_softplus=True)
    want = naive_selective_scan(**inputs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    names = list(inputs)
    grads_got = torch.autograd.grad(got.sum(), [inputs[k] for k in names])
    grads_want = torch.autograd.grad(want.sum(), [inputs[k] for k in names])
    for name, a, b in zip(names, grads_got, grads_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


def test_mamba_mixer_passes_the_kernel_layouts_correctly(monkeypatch) -> None:
    """The kernel path (faked on CPU by the reference recurrence) equals the torch path."""
    calls = []

    def fake_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
        calls.append("scan")
        assert delta_softplus and u.shape == delta.shape == z.shape
        assert B.shape == C.shape == (u.shape[0], A.shape[1], u.shape[2])
        return naive_selective_scan(u, delta, A, B, C, D, z, delta_bias)

    def fake_conv(x, weight, bias, activation=None):
        calls.append("conv")
        assert activation == "silu" and weight.shape == (x.shape[1], 4)
        padded = F.pad(x, (weight.shape[1] - 1, 0))
        out = sum(padded[..., k : k + x.shape[-1]] * weight[:, k, None] for k in range(4))
        return F.silu(out + bias[:, None])

    torch.manual_seed(0)
    mixer = MambaMixer(width=5, state_dim=4).double()
    randomize_output_projections(mixer)
    x = torch.randn(3, 7, 5, dtype=torch.float64)
    reference = mixer(x)
    monkeypatch.setattr(
        scan, "kernels", lambda: {"selective_scan": fake_scan, "causal_conv1d": fake_conv}
    )
    monkeypatch.setattr(scan, "use_kernel", lambda name, tensor, backend: True)
    torch.testing.assert_close(mixer(x), reference, rtol=1e-10, atol=1e-12)
    assert calls == ["conv", "scan"]


def test_cuda_backend_without_kernels_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="pfedseq-scan-backend"):
        scan.use_kernel("selective_scan", torch.zeros(1), "cuda")
    with pytest.raises(ValueError, match="allowed"):
        scan.use_kernel("selective_scan", torch.zeros(1), "triton")
    assert not scan.use_kernel("selective_scan", torch.zeros(1), "auto")  # CPU tensor


def test_config_tuples_match_the_implementations() -> None:
    assert SEQ_LEARNERS == LEARNERS
    assert SCAN_BACKENDS == scan.BACKENDS
    with pytest.raises(ConfigError, match="pfedseq-learner"):
        ExperimentConfig(pfedseq_learner="transformer").validate()
    with pytest.raises(ConfigError, match="pfedseq-conv-kernel"):
        ExperimentConfig(pfedseq_conv_kernel=5).validate()
    with pytest.raises(ConfigError, match="pfedseq-seq-len"):
        ExperimentConfig(pfedseq_seq_len=0).validate()


# ---------------------------------------------------------------- layout and learners
def test_layout_groups_by_layer_and_round_trips() -> None:
    tensors = initial_adapter()
    layout = ParameterLayout(tensors)
    assert [layer.key for layer in layout.layers] == ["backbone.blocks.0", "backbone.blocks.1"]
    assert [layer.size for layer in layout.layers] == [30, 30]
    back = layout.unflatten(layout.flatten(tensors))
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert layer_key("model.layers.11.self_attn.q_proj.lora_A.weight") == "model.layers.11"
    with pytest.raises(KeyError, match="missing"):
        layout.flatten({})


@pytest.mark.parametrize("kind", LEARNERS)
def test_learner_size_does_not_depend_on_the_adapter_size(kind: str) -> None:
    learner = SequenceLearner(LearnerSpec(kind=kind, seq_len=5), num_clients=N)
    count = sum(p.numel() for p in learner.parameters())
    for rows in (3, 1000):
        assert learner(torch.randn(rows, 5, N)).shape == (rows, N)
    assert sum(p.numel() for p in learner.parameters()) == count
    small = PFedSeqServer(PFedSeqSettings(learner=LearnerSpec(kind=kind)), initial_adapter(), N)
    big_adapter = {
        k: torch.zeros(v.shape[0] * 50, v.shape[1]) for k, v in initial_adapter().items()
    }
    big = PFedSeqServer(PFedSeqSettings(learner=LearnerSpec(kind=kind)), big_adapter, N)
    assert big.layout.size == 50 * small.layout.size
    assert big.num_learner_parameters() == small.num_learner_parameters()


@pytest.mark.parametrize("kind", LEARNERS)
def test_untrained_learner_calibrates_nothing(kind: str) -> None:
    learner = SequenceLearner(LearnerSpec(kind=kind, seq_len=5), num_clients=N)
    assert torch.equal(learner(torch.randn(8, 5, N)), torch.zeros(8, N))


@pytest.mark.parametrize("kind", LEARNERS)
def test_without_cross_client_modelling_no_client_sees_another(kind: str) -> None:
    torch.manual_seed(0)
    window = torch.randn(6, 5, N)
    other = window.clone()
    other[:, :, 2] += 1.0  # change client 2's whole history
    for cross_client in (False, True):
        learner = SequenceLearner(LearnerSpec(kind=kind, seq_len=5, cross_client=cross_client), N)
        randomize_output_projections(learner)
        a, b = learner(window), learner(other)
        keep = [0, 1, 3]
        if cross_client:
            assert not torch.allclose(a[:, keep], b[:, keep])
        else:
            torch.testing.assert_close(a[:, keep], b[:, keep], rtol=0, atol=1e-6)
            assert not torch.allclose(a[:, 2], b[:, 2])


def test_mamba_learner_is_causal() -> None:
    """The last step's output never depends on a future step: shorter windows are prefixes."""
    torch.manual_seed(0)
    learner = SequenceLearner(LearnerSpec(seq_len=6), N)
    randomize_output_projections(learner)
    window = torch.randn(5, 6, N)
    changed = window.clone()
    changed[:, 5] += 1.0
    stack = learner.core
    hidden_a, hidden_b = window, changed
    for norm, mixer in zip(stack.norms, stack.mixers, strict=True):
        hidden_a = hidden_a + mixer(norm(hidden_a))
        hidden_b = hidden_b + mixer(norm(hidden_b))
    torch.testing.assert_close(hidden_a[:, :5], hidden_b[:, :5])


# ---------------------------------------------------------------- the server step
def test_global_adapter_is_the_example_weighted_average_eq1() -> None:
    server = make_server(warmup_rounds=3)
    before = server.personal.clone().numpy().astype(np.float64)
    updates = random_updates(server, 0, clients=[0, 2, 3])
    counts = {0: 10, 2: 30, 3: 60}
    server.step(updates, counts)
    want = sum(counts[c] * (before[c] + updates[c].numpy()) for c in counts) / 100
    np.testing.assert_allclose(server.global_adapter.numpy(), want, rtol=1e-6, atol=1e-9)


def test_warmup_sends_the_global_adapter_then_personalized_ones() -> None:
    server = make_server(warmup_rounds=3)
    for t in range(1, 6):
        run_rounds(server, range(t, t + 1))
        payloads = [server.layout.flatten(server.adapter_for(c)) for c in range(N)]
        if t <= 3:
            assert all(torch.equal(p, server.global_adapter) for p in payloads)
        else:
            assert not torch.equal(payloads[0], payloads[1])


def expected_calibrations(server: PFedSeqServer) -> torch.Tensor:
    """xi from the history by hand: stacked window, per-layer RMS scale, each layer's learner."""
    window = torch.stack(server.history, dim=1)  # (D, L, N)
    masks = torch.stack(server.masks)  # (L, N)
    out = []
    for index, layer in enumerate(server.layout.layers):
        part = window[layer.start : layer.stop].double()
        reported = masks.sum() * layer.size
        scale = float((part.pow(2).sum() / reported).sqrt())
        out.append(server.learners[index]((part / scale).float()) * scale)
    return torch.cat(out).detach()


def test_personalized_adapter_is_global_plus_calibration_eq3() -> None:
    server = make_server(warmup_rounds=1, spec={"kind": "mamba"})
    run_rounds(server, range(4))
    xi = expected_calibrations(server)
    assert xi.abs().max() > 0
    torch.testing.assert_close(
        server.personal, server.global_adapter[None] + xi.t(), rtol=0, atol=1e-7
    )


def test_variant_a_sends_the_learner_output_itself() -> None:
    server = make_server(warmup_rounds=1, global_aggregation=False)
    run_rounds(server, range(4))
    torch.testing.assert_close(
        server.personal, expected_calibrations(server).t(), rtol=0, atol=1e-7
    )


def test_history_is_capped_at_seq_len() -> None:
    server = make_server(seq_len=3)
    run_rounds(server, range(7))
    assert len(server.history) == len(server.masks) == 3
    last = random_updates(server, 6)
    assert torch.equal(server.history[-1][:, 1], last[1])
    assert torch.equal(server.history[0][:, 1], random_updates(server, 4)[1])


def test_learner_gradient_is_autograd_of_the_eq5_surrogate() -> None:
    server = make_server(warmup_rounds=1)
    run_rounds(server, range(3))
    randomize_output_projections(server.learners)
    updates = random_updates(server, 99, clients=[0, 1, 3])  # client 2 does not report
    matrix = torch.zeros(server.layout.size, N)
    mask = torch.zeros(N)
    for c, u in updates.items():
        matrix[:, c] = u
        mask[c] = 1.0
    server.accumulate_surrogate_gradient(matrix, mask)
    got = [p.grad.clone() for p in server.learners.parameters()]
    # eq. 5 as a vector-Jacobian product of xi^{t-1} with the reported updates, negated for descent
    xi = torch.cat(
        [
            server.learners[i](server_window(server, layer) / s) * s
            for i, (layer, s) in enumerate(layer_scales(server))
        ]
    )
    vjp = torch.autograd.grad(xi, list(server.learners.parameters()), grad_outputs=matrix * mask)
    for a, b in zip(got, vjp, strict=True):
        torch.testing.assert_close(a, -b, rtol=1e-5, atol=1e-9)
    assert any(g.abs().max() > 0 for g in got)


def server_window(server: PFedSeqServer, layer) -> torch.Tensor:
    return torch.stack(server.history, dim=1)[layer.start : layer.stop]


def layer_scales(server: PFedSeqServer):
    return [
        (layer, server.input_scale(layer, server.history, server.masks))
        for layer in server.layout.layers
    ]


@pytest.mark.parametrize("reporting", [[0], [2], [0, 1, 2, 3]])
def test_one_small_step_moves_old_calibrations_towards_the_updates(reporting) -> None:
    server = make_server(warmup_rounds=1, lr=1e-4)
    run_rounds(server, range(4))
    randomize_output_projections(server.learners)
    old = server.calibrations()
    updates = random_updates(server, 50, clients=reporting)
    server.step(updates, {c: 5 for c in reporting})
    # ``calibrations`` now reads the new history; recompute xi^{t-1} from the old window
    window_old = [h for h in server.history[:-1]]
    masks_old = [m for m in server.masks[:-1]]
    new = server.calibrations(window_old, masks_old)
    gains = [float((new[:, c] - old[:, c]) @ updates[c]) for c in reporting]
    if len(reporting) == 1:
        assert gains[0] > 0, gains
    assert sum(gains) > 0, gains


def test_chunked_and_unchunked_learners_agree() -> None:
    whole = make_server(chunk_size=10_000)
    chunked = make_server(chunk_size=7)
    for server in (whole, chunked):
        run_rounds(server, range(5))
    torch.testing.assert_close(chunked.personal, whole.personal, rtol=1e-5, atol=1e-8)
    for a, b in zip(chunked.learners.parameters(), whole.learners.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-9)
    assert whole.chunk_rows(5) == 10_000


def test_non_reporting_clients_enter_the_sequence_as_zero_and_stay_out_of_eq1() -> None:
    server = make_server(warmup_rounds=10)
    run_rounds(server, range(2))
    before = server.personal.clone()
    updates = random_updates(server, 7, clients=[1, 3])
    server.step(updates, {1: 20, 3: 20})
    assert torch.equal(server.history[-1][:, 0], torch.zeros(server.layout.size))
    assert server.masks[-1].tolist() == [0.0, 1.0, 0.0, 1.0]
    want = (before[1] + updates[1] + before[3] + updates[3]) / 2
    torch.testing.assert_close(server.global_adapter, want)


@pytest.mark.parametrize("kind", LEARNERS)
def test_checkpoint_and_resume_are_exact(kind: str, tmp_path) -> None:
    uninterrupted = make_server(spec={"kind": kind}, warmup_rounds=2)
    run_rounds(uninterrupted, range(7))
    first = make_server(spec={"kind": kind}, warmup_rounds=2)
    run_rounds(first, range(4))
    save_file(first.state_tensors(), str(tmp_path / "state.safetensors"))
    resumed = make_server(spec={"kind": kind}, warmup_rounds=2)
    resumed.load_state_tensors(load_file(str(tmp_path / "state.safetensors")))
    run_rounds(resumed, range(4, 7))
    a, b = uninterrupted.state_tensors(), resumed.state_tensors()
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_client_id_outside_the_channels_is_a_clear_error() -> None:
    server = make_server()
    with pytest.raises(ValueError, match="client-id 7 is outside"):
        server.adapter_for(7)
