"""pFedSeq: selective scan, sequential learners and the server step against independent math."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fedfm_flower.config.experiment import ConfigError, ExperimentConfig
from fedfm_flower.learners import fused_scan, triton_scan
from fedfm_flower.learners import selective_scan as scan
from fedfm_flower.learners import stacked as stacked_module
from fedfm_flower.learners.layout import ParameterLayout, layer_key
from fedfm_flower.learners.mamba import MambaMixer
from fedfm_flower.learners.pfedseq import PFedSeqServer, PFedSeqSettings
from fedfm_flower.learners.quadratic import QuadraticFederation, fedavg_settings, run_quadratic
from fedfm_flower.learners.sequence import LearnerSpec, SequenceLearner
from fedfm_flower.learners.stacked import StackedLearners
from fedfm_flower.methods.pfedseq import INPUT_SCALES, LEARNERS

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
    settings = PFedSeqSettings(
        seq_len=changes.pop("seq_len", 5),
        warmup_rounds=changes.pop("warmup_rounds", 1),
        lr=changes.pop("lr", 1e-2),
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


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    """Equal within ``rtol`` of each entry plus ``rtol`` of the tensor's largest magnitude.

    Float32 rounding differs between the layer-batched and the per-layer path (other matmul
    blockings and summation orders), so entries near zero can differ by more than ``rtol`` of
    themselves; the second term bounds them against the tensor's scale instead.
    """
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale)


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
    y = torch.stack(channels, 1)
    return y if z is None else y * z * torch.sigmoid(z)


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


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_compiled_scan_matches_the_eager_scan_and_compiles_once_per_shape() -> None:
    """The compiled steps give the eager loop's values and gradients within float32 rounding;
    other batch sizes (chunks) and window lengths (early rounds) reuse the compiled graphs."""
    groups, channels, n = 2, 8, 16  # the shape of ``make_server(scan_backend='compiled')``
    scan.check_compiled(groups, channels, n)
    made = compiled_graphs()
    g = torch.Generator().manual_seed(3)
    for batch, steps in ((5, 3), (9, 6), (9, 6)):
        dim = groups * channels
        inputs = [
            torch.randn(batch, dim, steps, generator=g),
            0.2 * torch.rand(batch, dim, steps, generator=g),
            -torch.rand(dim, n, generator=g) - 0.1,
            torch.randn(batch, groups, n, steps, generator=g),
            torch.randn(batch, groups, n, steps, generator=g),
        ]
        for last_only in (False, True):
            results = []
            for compiled in (False, True):
                leaves = [t.clone().requires_grad_() for t in inputs]
                out = scan._grouped_scan(*leaves, last_only=last_only, compiled=compiled)
                grads = torch.autograd.grad((out * out.detach()).sum(), leaves)
                with torch.no_grad():
                    inference = scan._grouped_scan(*inputs, last_only=last_only, compiled=compiled)
                results.append((out.detach(), inference, *grads))
            for got, want in zip(results[1], results[0], strict=True):
                assert_close_to_scale(got, want)
    assert compiled_graphs() == made


def test_compiled_server_steps_match_the_eager_server() -> None:
    """pfedseq-scan-backend = 'compiled': adapters, calibrations and learners as with 'torch'."""
    eager, compiled = (make_server(scan_backend=backend) for backend in ("torch", "compiled"))
    start = {name: p.detach().clone() for name, p in eager.learners.named_parameters()}
    for server in (eager, compiled):
        run_mixed_rounds(server, range(6))
    assert_same_servers(compiled, eager, start)


def test_a_compiled_backend_that_cannot_compile_is_refused_at_start(monkeypatch) -> None:
    def broken():
        def fail(*args):
            raise OSError("no C++ compiler found")

        return fail

    monkeypatch.setattr(scan, "_compiled_step", broken)
    scan.check_compiled.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="'compiled' but torch.compile failed.*C\\+\\+"):
            make_server(scan_backend="compiled")
    finally:
        scan.check_compiled.cache_clear()


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"input_scale": "layer"}, "pfedseq-input-scale"),
        ({"learner_update": "sgd"}, "pfedseq-learner-update"),
        ({"batch_rows": 0}, "pfedseq-batch-rows"),
        ({"output_init": "xavier"}, "pfedseq-output-init"),
        ({"learner": "transformer"}, "pfedseq-learner"),
        ({"conv_kernel": 5}, "pfedseq-conv-kernel"),
        ({"seq_len": 0}, "pfedseq-seq-len"),
        ({"scan_backend": "triton"}, "pfedseq-scan-backend"),
    ],
)
def test_bad_settings_fail_in_the_settings_and_the_config(changes: dict, key: str) -> None:
    """The settings class is the one place of pFedSeq's rules; the config applies them."""
    with pytest.raises(ConfigError, match=f"'{key}'"):
        PFedSeqSettings(**changes)
    ((name, value),) = changes.items()
    with pytest.raises(ConfigError, match=f"'{key}'"):
        ExperimentConfig().replace(**{f"pfedseq_{name}": value})
    with pytest.raises(ConfigError, match=f"'{key}'"):
        ExperimentConfig.from_run_config({key: value})


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
    small = PFedSeqServer(PFedSeqSettings(learner=kind), initial_adapter(), N)
    big_adapter = {
        k: torch.zeros(v.shape[0] * 50, v.shape[1]) for k, v in initial_adapter().items()
    }
    big = PFedSeqServer(PFedSeqSettings(learner=kind), big_adapter, N)
    assert big.layout.size == 50 * small.layout.size
    assert big.num_learner_parameters() == small.num_learner_parameters()


def test_learner_spec_is_read_from_the_typed_settings() -> None:
    assert LearnerSpec() == LearnerSpec.from_settings(PFedSeqSettings())  # one set of defaults
    config = ExperimentConfig().replace(
        pfedseq_learner="lstm",
        pfedseq_num_layers=3,
        pfedseq_state_dim=8,
        pfedseq_expand=4,
        pfedseq_conv_kernel=3,
        pfedseq_mlp_hidden=50,
        pfedseq_seq_len=7,
        pfedseq_cross_client=False,
        pfedseq_scan_backend="torch",
        pfedseq_output_init="reference",
    )
    spec = LearnerSpec.from_settings(config.settings_of(PFedSeqSettings))
    assert spec == LearnerSpec("lstm", 3, 8, 4, 3, 50, 7, False, "torch", "reference")


@pytest.mark.parametrize("kind", LEARNERS)
def test_untrained_learner_calibrates_nothing(kind: str) -> None:
    learner = SequenceLearner(LearnerSpec(kind=kind, seq_len=5), num_clients=N)
    assert torch.equal(learner(torch.randn(8, 5, N)), torch.zeros(8, N))


def test_reference_output_init_is_gu_and_dao_rescaled_kaiming() -> None:
    """``reference``: Kaiming-uniform out-projections divided by sqrt(num_layers)."""
    torch.manual_seed(0)
    spec = LearnerSpec(seq_len=5, num_layers=3, output_init="reference")
    learner = SequenceLearner(spec, num_clients=N)
    for mixer in learner.core.mixers:
        weight = mixer.out_proj.weight.detach()
        bound = 1 / np.sqrt(weight.shape[1]) / np.sqrt(3)  # kaiming_uniform(a=sqrt 5) bound
        assert float(weight.abs().max()) <= bound
        assert float(weight.abs().max()) > 0.8 * bound  # uniform over the range, not zero
    assert learner(torch.randn(8, 5, N) * 1e-3).abs().max() > 0


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


def reference_scales(server: PFedSeqServer, part: torch.Tensor, masks: torch.Tensor):
    """The input divisor of one layer's (rows, L, N) window, written out per mode."""
    if server.settings.input_scale == "none":
        return torch.ones(N, dtype=torch.float64)
    reported = masks.double() * part.shape[0]  # (L, N) entries that were reported
    if server.settings.cross_client:
        return (part.pow(2).sum() / reported.sum()).sqrt().expand(N)
    return (part.pow(2).sum((0, 1)) / reported.sum(0)).sqrt()  # each client its own RMS


def expected_calibrations(server: PFedSeqServer, history=None, masks=None) -> torch.Tensor:
    """xi from a window by hand: stacked window, the mode's scale, each layer's learner."""
    window = torch.stack(server.history if history is None else history, dim=1)  # (D, L, N)
    masks = torch.stack(server.masks if masks is None else masks)  # (L, N)
    out = []
    for index, layer in enumerate(server.layout.layers):
        part = window[layer.start : layer.stop].double()
        scale = reference_scales(server, part, masks)
        xi = server.learners[index]((part / scale).float())
        out.append(xi * scale.float() if server.settings.input_scale == "rms-rescale" else xi)
    return torch.cat(out)


@pytest.mark.parametrize("input_scale", INPUT_SCALES)
@pytest.mark.parametrize("cross_client", [True, False])
def test_personalized_adapter_is_global_plus_calibration_eq3(input_scale, cross_client) -> None:
    server = make_server(warmup_rounds=1, input_scale=input_scale, cross_client=cross_client)
    run_rounds(server, range(4))
    xi = expected_calibrations(server).detach()
    assert xi.abs().max() > 0
    torch.testing.assert_close(
        server.personal, server.global_adapter[None] + xi.t(), rtol=1e-5, atol=1e-7
    )


def test_default_calibration_is_the_learner_output_on_the_raw_updates() -> None:
    """The paper's path (eq. 2): no scale in or out, xi in the units of the updates."""
    server = make_server(warmup_rounds=1)
    assert server.settings.input_scale == "none"
    run_rounds(server, range(4))
    window = torch.stack(server.history, dim=1)
    want = torch.cat(
        [
            server.learners[i](window[layer.start : layer.stop])
            for i, layer in enumerate(server.layout.layers)
        ]
    ).detach()
    assert_close_to_scale(server.calibrations(), want)  # the default, layer-batched path
    server.batch_layers = False
    assert torch.equal(server.calibrations(), want)  # the per-layer loop: the modules' own call


def test_variant_a_sends_the_learner_output_itself() -> None:
    server = make_server(warmup_rounds=1, global_aggregation=False)
    run_rounds(server, range(4))
    torch.testing.assert_close(
        server.personal, expected_calibrations(server).detach().t(), rtol=0, atol=1e-7
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
    xi = expected_calibrations(server)
    vjp = torch.autograd.grad(xi, list(server.learners.parameters()), grad_outputs=matrix * mask)
    for a, b in zip(got, vjp, strict=True):
        torch.testing.assert_close(a, -b, rtol=1e-5, atol=1e-9)
    assert any(g.abs().max() > 0 for g in got)


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
    # Chunks sum the learners' gradients in another order; after 5 rounds of Adam that leaves
    # float32 differences up to 1.3x rtol 1e-5 on some CPUs (2.9e-5 relative on one element of
    # 32, 2026-11-29): the same result, rounded differently, not a different one.
    for a, b in zip(chunked.learners.parameters(), whole.learners.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
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
    uninterrupted = make_server(learner=kind, warmup_rounds=2)
    run_rounds(uninterrupted, range(7))
    first = make_server(learner=kind, warmup_rounds=2)
    run_rounds(first, range(4))
    save_file(first.state_tensors(), str(tmp_path / "state.safetensors"))
    resumed = make_server(learner=kind, warmup_rounds=2)
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


# ---------------------------------------------------------------- behaviour the issue pins
@pytest.mark.parametrize("input_scale", INPUT_SCALES)
def test_variant_c_calibration_depends_on_the_clients_own_history_only(input_scale) -> None:
    """Changing client 2's history (and whether it reported) leaves every other xi_i as is."""
    server = make_server(warmup_rounds=1, input_scale=input_scale, cross_client=False, seq_len=4)
    run_rounds(server, range(6))
    randomize_output_projections(server.learners)
    history = [h.clone() for h in server.history]
    masks = [m.clone() for m in server.masks]
    changed = [h.clone() for h in history]
    changed_masks = [m.clone() for m in masks]
    for step, h in enumerate(changed):
        h[:, 2] = h[:, 2] * 40.0 + 0.01 * step
    changed_masks[1][2] = 0.0  # client 2 also "did not report" one round
    changed[1][:, 2] = 0.0
    a = server.calibrations(history, masks)
    b = server.calibrations(changed, changed_masks)
    others = [0, 1, 3]
    assert torch.equal(a[:, others], b[:, others])
    assert not torch.allclose(a[:, 2], b[:, 2])
    full = make_server(warmup_rounds=1, input_scale=input_scale, seq_len=4)
    full.learners.load_state_dict(server.learners.state_dict(), strict=False)
    randomize_output_projections(full.learners)
    a, b = full.calibrations(history, masks), full.calibrations(changed, changed_masks)
    assert not torch.allclose(a[:, others], b[:, others])  # cross-client modelling does mix


def one_step_gradients(backend_fn=None) -> dict[str, torch.Tensor | None]:
    """Gradients of a fresh learner's surrogate on a one-step window (first server step)."""
    torch.manual_seed(0)
    learner = SequenceLearner(LearnerSpec(seq_len=5), N)
    randomize_output_projections(learner)
    window = torch.randn(16, 1, N) * 1e-3
    (learner(window) * torch.randn(16, N)).sum().backward()
    return {name: p.grad for name, p in learner.named_parameters()}


def test_torch_scan_gives_a_real_zero_gradient_to_a_on_a_one_step_window() -> None:
    """As the kernel does: every parameter has a gradient, A_log's is exactly zero."""
    grads = one_step_gradients()
    a_logs = [name for name in grads if name.endswith("A_log")]
    assert a_logs and all(grads[name] is not None for name in grads)
    assert all(torch.equal(grads[name], torch.zeros_like(grads[name])) for name in a_logs)
    assert any(grads[name].abs().max() > 0 for name in grads if "out_proj" in name)


def test_adam_counts_every_step_for_every_learner_parameter() -> None:
    """After a one-step window (the first learner update) all Adam step counters agree."""
    server = make_server(warmup_rounds=1, seq_len=3)
    run_rounds(server, range(3))  # learner updates from windows of 1 and 2 steps
    steps = {float(state["step"]) for state in server.optimizer.state_dict()["state"].values()}
    assert steps == {2.0}
    assert len(server.optimizer.state_dict()["state"]) == len(list(server.learners.parameters()))


@pytest.mark.skipif(
    not (torch.cuda.is_available() and "selective_scan" in scan.kernels()),
    reason="needs mamba_ssm's CUDA kernel",
)
def test_kernel_and_torch_scan_gradients_agree_on_the_first_step() -> None:
    torch.manual_seed(0)
    inputs = {k: v.float().cuda().requires_grad_() for k, v in scan_inputs(steps=1).items()}
    grads = {}
    for backend in ("torch", "cuda"):
        out = scan.selective_scan(**inputs, delta_softplus=True, backend=backend)
        grads[backend] = torch.autograd.grad(out.sum(), list(inputs.values()))
    for name, a, b in zip(inputs, grads["torch"], grads["cuda"], strict=True):
        assert a is not None and b is not None, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_mini_batch_update_takes_one_adam_step_per_batch_of_rows() -> None:
    """D/32 reading (paper, appendix A): ceil(layer size / batch-rows) steps per layer."""
    server = make_server(warmup_rounds=1, learner_update="mini-batch", batch_rows=8)
    run_rounds(server, range(3))  # two learner updates
    per_layer = -(-server.layout.layers[0].size // 8)  # 30 rows -> 4 batches
    steps = {float(state["step"]) for state in server.optimizer.state_dict()["state"].values()}
    assert steps == {2.0 * per_layer}
    full = make_server(warmup_rounds=1)
    run_rounds(full, range(3))
    assert not torch.equal(full.personal, server.personal)


def test_mini_batch_update_with_one_batch_is_the_full_batch_step() -> None:
    whole = make_server(warmup_rounds=1)
    batched = make_server(warmup_rounds=1, learner_update="mini-batch", batch_rows=10_000)
    for server in (whole, batched):
        run_rounds(server, range(5))
    torch.testing.assert_close(batched.personal, whole.personal, rtol=1e-5, atol=1e-9)


def test_mini_batch_checkpoint_and_resume_are_exact(tmp_path) -> None:
    uninterrupted = make_server(warmup_rounds=2, learner_update="mini-batch", batch_rows=7)
    run_rounds(uninterrupted, range(6))
    first = make_server(warmup_rounds=2, learner_update="mini-batch", batch_rows=7)
    run_rounds(first, range(3))
    save_file(first.state_tensors(), str(tmp_path / "state.safetensors"))
    resumed = make_server(warmup_rounds=2, learner_update="mini-batch", batch_rows=7)
    resumed.load_state_tensors(load_file(str(tmp_path / "state.safetensors")))
    run_rounds(resumed, range(3, 6))
    a, b = uninterrupted.state_tensors(), resumed.state_tensors()
    assert all(torch.equal(a[name], b[name]) for name in a)


# ---------------------------------------------------------------- layer batching
UNEQUAL_ADAPTER = {  # three layers of different sizes: 30, 12 and 5 rows ("<no-layer>")
    "backbone.blocks.0.attn.qkv.lora_A.default.weight": (2, 6),
    "backbone.blocks.0.attn.qkv.lora_B.default.weight": (9, 2),
    "backbone.blocks.1.attn.qkv.lora_A.default.weight": (2, 3),
    "backbone.blocks.1.attn.qkv.lora_B.default.weight": (3, 2),
    "head.lora.weight": (5,),
}


def unequal_adapter() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(*shape, generator=g) * 0.1 for k, shape in UNEQUAL_ADAPTER.items()}


def twin_servers(**changes) -> tuple[PFedSeqServer, PFedSeqServer]:
    """The per-layer loop and the layer-batched path with the same settings and seed."""
    settings = PFedSeqSettings(
        seq_len=changes.pop("seq_len", 4),
        warmup_rounds=changes.pop("warmup_rounds", 1),
        lr=changes.pop("lr", 1e-2),
        **changes,
    )
    loop, batched = (
        PFedSeqServer(settings, unequal_adapter(), N, seed=0, batch_layers=flag)
        for flag in (False, True)
    )
    return loop, batched


def run_mixed_rounds(server: PFedSeqServer, rounds: range) -> None:
    """Rounds with full and partial participation (every third round: clients 0 and 2)."""
    for t in rounds:
        run_rounds(server, range(t, t + 1), clients=[0, 2] if t % 3 == 2 else range(N))


def assert_same_servers(got: PFedSeqServer, want: PFedSeqServer, start: dict) -> None:
    """Adapters, calibrations, learner moves and gradients, Adam state: equal to the scale."""
    assert got.round == want.round
    assert_close_to_scale(got.global_adapter, want.global_adapter)
    assert_close_to_scale(got.personal, want.personal)
    assert_close_to_scale(got.calibrations(), want.calibrations())
    got_params = dict(got.learners.named_parameters())
    for name, param in want.learners.named_parameters():
        assert (param - start[name]).abs().max() > 0 or "A_log" in name, name  # it did train
        assert_close_to_scale(got_params[name].detach(), param.detach())
        if want.settings.learner_update == "full-batch":  # mini-batch: the last batch's only
            assert_close_to_scale(got_params[name].grad, param.grad)
    got_state, want_state = got.state_tensors(), want.state_tensors()
    assert set(got_state) == set(want_state)
    for name in want_state:
        if name.startswith("adam."):
            assert_close_to_scale(got_state[name], want_state[name])


@pytest.mark.parametrize(
    "changes",
    [
        {},  # the paper's Mamba learner, full-batch update
        {"learner_update": "mini-batch", "batch_rows": 4},
        {"learner_update": "mini-batch", "batch_rows": 7, "learner": "lstm"},
        {"global_aggregation": False},  # variant A
        {"seq_len": 1},  # variant B
        {"cross_client": False, "input_scale": "rms"},  # variant C
        {"learner": "mlp"},  # variant D
        {"learner": "lstm"},  # variant E
        {"input_scale": "rms-rescale", "output_init": "reference", "num_layers": 3},
        {"chunk_size": 9},  # 3 rows a layer per chunk: shorter layers padded, then left out
    ],
    ids=lambda changes: ",".join(f"{k}={v}" for k, v in changes.items()) or "paper",
)
def test_layer_batched_step_matches_the_per_layer_loop(changes: dict) -> None:
    """Calibrations, adapters, learner parameters and Adam state after several steps."""
    loop, batched = twin_servers(**changes)
    start = {name: p.detach().clone() for name, p in loop.learners.named_parameters()}
    pairs = zip(loop.learners.parameters(), batched.learners.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)  # the same initial learners
    for server in (loop, batched):
        run_mixed_rounds(server, range(6))
    assert_same_servers(batched, loop, start)


def test_layer_batched_surrogate_gradient_matches_the_loop() -> None:
    """One eq. 5 backward pass with every parameter in play (non-zero output projections)."""
    loop, batched = twin_servers(chunk_size=7)
    for server in (loop, batched):
        run_mixed_rounds(server, range(3))
    randomize_output_projections(loop.learners)
    batched.learners.load_state_dict(loop.learners.state_dict())
    updates = random_updates(loop, 77, clients=[0, 1, 3])
    matrix = torch.zeros(loop.layout.size, N)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    for c, u in updates.items():
        matrix[:, c] = u
    values = [server.accumulate_surrogate_gradient(matrix, mask) for server in (loop, batched)]
    assert values[1] == pytest.approx(values[0], rel=1e-5)
    for p, q in zip(loop.learners.parameters(), batched.learners.parameters(), strict=True):
        assert p.grad.abs().max() > 0
        assert_close_to_scale(q.grad, p.grad)


def test_layer_batched_mini_batches_skip_only_the_layer_with_a_non_finite_gradient() -> None:
    """As in the loop, a layer whose gradient is not finite keeps its learner; the others step."""
    loop, batched = twin_servers(learner_update="mini-batch", batch_rows=8)
    for server in (loop, batched):
        run_mixed_rounds(server, range(3))
        with torch.no_grad():
            server.learners[1].core.norms[0].weight[0] = float("nan")
    for server in (loop, batched):
        before = [p.detach().clone() for p in server.learners[1].parameters()]
        run_mixed_rounds(server, range(3, 4))
        for p, q in zip(server.learners[1].parameters(), before, strict=True):
            torch.testing.assert_close(p.detach(), q, rtol=0, atol=0, equal_nan=True)
    for index in (0, 2):
        pairs = zip(
            loop.learners[index].parameters(), batched.learners[index].parameters(), strict=True
        )
        for p, q in pairs:
            assert_close_to_scale(q.detach(), p.detach())


@pytest.mark.parametrize("learner_update", ["full-batch", "mini-batch"])
def test_checkpoints_resume_across_the_loop_and_the_batched_path(learner_update, tmp_path) -> None:
    """A checkpoint of either path loads into the other and resumes the same run."""
    changes = {"learner_update": learner_update, "batch_rows": 8, "warmup_rounds": 2}
    reference, _ = twin_servers(**changes)
    start = {name: p.detach().clone() for name, p in reference.learners.named_parameters()}
    run_mixed_rounds(reference, range(7))
    for first_batched in (False, True):
        first = twin_servers(**changes)[int(first_batched)]
        run_mixed_rounds(first, range(4))
        save_file(first.state_tensors(), str(tmp_path / "state.safetensors"))
        written = load_file(str(tmp_path / "state.safetensors"))
        resumed = twin_servers(**changes)[int(not first_batched)]
        resumed.load_state_tensors(written)
        again = resumed.state_tensors()  # the same format: loads and writes back unchanged
        assert set(again) == set(written)
        assert all(torch.equal(again[name], written[name]) for name in written)
        run_mixed_rounds(resumed, range(4, 7))
        assert_same_servers(resumed, reference, start)


@pytest.mark.parametrize("kind", LEARNERS)
@pytest.mark.parametrize("cross_client", [True, False])
def test_stacked_learners_are_each_layers_learner_in_float64(kind: str, cross_client: bool) -> None:
    """The batched arithmetic is the modules' own: equal to float64 rounding, per layer."""
    torch.manual_seed(0)
    spec = LearnerSpec(kind=kind, seq_len=5, num_layers=2, cross_client=cross_client)
    learners = torch.nn.ModuleList(SequenceLearner(spec, N) for _ in range(3)).double()
    for index, learner in enumerate(learners):
        randomize_output_projections(learner, seed=index)
    stacked = StackedLearners(learners)
    window = torch.randn(3, 6, 4, N, dtype=torch.float64)  # 4 of the 5 steps
    got = stacked(stacked.stack(), window)
    for index, learner in enumerate(learners):
        torch.testing.assert_close(got[index], learner(window[index]), rtol=1e-10, atol=1e-12)


def naive_grouped_selective_scan(u, delta, A, B, C, D, z, delta_bias):
    """One ``naive_selective_scan`` per group of channels, each with its own B and C."""
    per = u.shape[1] // B.shape[1]
    parts = []
    for g in range(B.shape[1]):
        c = slice(g * per, (g + 1) * per)
        gate = None if z is None else z[:, c]
        parts.append(
            naive_selective_scan(
                u[:, c], delta[:, c], A[c], B[:, g], C[:, g], D[c], gate, delta_bias[c]
            )
        )
    return torch.cat(parts, 1)


def grouped_scan_inputs(groups: int = 3) -> dict[str, torch.Tensor]:
    inputs = scan_inputs(dim=2 * groups)
    g = torch.Generator().manual_seed(9)
    batch, n, steps = inputs["B"].shape
    inputs["B"] = torch.randn(batch, groups, n, steps, generator=g, dtype=torch.float64)
    inputs["C"] = torch.randn(batch, groups, n, steps, generator=g, dtype=torch.float64)
    return inputs


def test_grouped_torch_scan_is_one_scan_per_group_values_gradients_last_step() -> None:
    inputs = {k: v.requires_grad_() for k, v in grouped_scan_inputs().items()}
    got = scan.selective_scan_torch(**inputs, delta_softplus=True)
    want = naive_grouped_selective_scan(**inputs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    names = list(inputs)
    grads_got = torch.autograd.grad(got.sum(), [inputs[k] for k in names])
    grads_want = torch.autograd.grad(want.sum(), [inputs[k] for k in names])
    for name, a, b in zip(names, grads_got, grads_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)
    last = {**inputs, "z": inputs["z"][..., -1:]}
    with torch.no_grad():  # also the in-place inference path
        for groups in ("grouped", "shared"):
            args = (
                last
                if groups == "grouped"
                else {**last, "B": last["B"][:, 0], "C": last["C"][:, 0]}
            )
            full = scan.selective_scan_torch(**{**args, "z": inputs["z"]}, delta_softplus=True)
            only = scan.selective_scan_torch(**args, delta_softplus=True, last_only=True)
            torch.testing.assert_close(only, full[..., -1:], rtol=1e-12, atol=1e-14)


def fake_conv(x, weight, bias, activation=None):
    """causal_conv1d_fn's contract written out: SiLU of a left-padded depthwise conv."""
    assert activation == "silu" and weight.shape[0] == x.shape[1]
    width = weight.shape[1]
    padded = F.pad(x, (width - 1, 0))
    out = sum(padded[..., k : k + x.shape[-1]] * weight[:, k, None] for k in range(width))
    return F.silu(out + bias[:, None])


def test_stacked_learners_pass_the_kernel_layouts_correctly(monkeypatch) -> None:
    """Layers folded into channels and B, C groups on the (faked) kernels equal the torch path."""
    calls = []

    def fake_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
        calls.append("scan")
        assert delta_softplus and u.shape == delta.shape and B.dim() == 4
        assert B.shape == C.shape == (u.shape[0], 3, A.shape[1], u.shape[2])
        assert z is None or z.shape == u.shape  # the kernel gets every step or no gate
        return naive_grouped_selective_scan(u, delta, A, B, C, D, z, delta_bias)

    def counted_conv(*args, **kwargs):
        calls.append("conv")
        return fake_conv(*args, **kwargs)

    torch.manual_seed(0)
    learners = torch.nn.ModuleList(SequenceLearner(LearnerSpec(seq_len=5), N) for _ in range(3))
    learners = learners.double()
    for index, learner in enumerate(learners):
        randomize_output_projections(learner, seed=index)
    stacked = StackedLearners(learners)
    window = torch.randn(3, 7, 5, N, dtype=torch.float64)
    reference = stacked(stacked.stack(), window)
    monkeypatch.setattr(
        scan, "kernels", lambda: {"selective_scan": fake_scan, "causal_conv1d": counted_conv}
    )
    monkeypatch.setattr(scan, "use_kernel", lambda name, tensor, backend: True)
    monkeypatch.setattr(stacked_module, "use_kernel", lambda name, tensor, backend: True)
    torch.testing.assert_close(stacked(stacked.stack(), window), reference, rtol=1e-10, atol=1e-12)
    assert calls == ["conv", "scan", "conv", "scan"]


QUADRATIC = QuadraticFederation(num_layers=2, layer_size=128)
QUADRATIC_ROUNDS = 16


def quadratic_settings(**changes) -> PFedSeqSettings:
    """The paper's server settings (Adam 1e-3, 2-layer Mamba, W = 10, L = 10)."""
    return PFedSeqSettings(seq_len=10, warmup_rounds=10, lr=1e-3, **changes)


def test_calibrations_act_right_after_the_warm_up() -> None:
    """With the defaults, xi is a material fraction of an update from the first rounds.

    Bound: calibration RMS >= 0.25 x update RMS in every round after the warm-up. A fraction of
    that size changes the adapter a client starts from by as much as a quarter of its own
    round's training; the earlier default (input scaled and output multiplied back) stayed at
    ~0.01-0.05 here, as on the offline ViT setups, which changes nothing.
    """
    run = run_quadratic(quadratic_settings(), QUADRATIC, QUADRATIC_ROUNDS)
    after = run.ratios[10:]
    assert min(after) >= 0.25, after
    old = run_quadratic(quadratic_settings(input_scale="rms-rescale"), QUADRATIC, QUADRATIC_ROUNDS)
    assert max(old.ratios[10:]) < 0.1, old.ratios[10:]


def test_calibrations_personalize_better_than_fedavg_on_the_quadratic_federation() -> None:
    """After the warm-up the personalized error falls below FedAvg's (theta_i = theta_g)."""
    settings = quadratic_settings()
    run = run_quadratic(settings, QUADRATIC, QUADRATIC_ROUNDS)
    fedavg = run_quadratic(fedavg_settings(settings, QUADRATIC_ROUNDS), QUADRATIC, QUADRATIC_ROUNDS)
    assert run.errors[:10] == fedavg.errors[:10]  # identical during the warm-up
    assert run.errors[-1] < 0.8 * fedavg.errors[-1], (run.errors[-1], fedavg.errors[-1])


# ----------------------------------------------------------------- the fused CPU scan
needs_fused = pytest.mark.skipif(not fused_scan.available(), reason="no C compiler here")


@needs_fused
@pytest.mark.parametrize("n", [16, 5])  # the build for Mamba's default state size, and any
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("steps", [1, 6])
@pytest.mark.parametrize("last_only", [False, True])
def test_fused_scan_equals_the_eager_loop_values_and_every_gradient(
    groups: int, steps: int, last_only: bool, n: int
) -> None:
    """float64: the fused C recurrence gives the eager loop's outputs and the gradients of u,
    delta, A, B and C to 1e-12 (1-step windows too, where A's gradient is a real zero); more
    than 64 rows, so the rows are split over threads and dA summed over their buffers."""
    g = torch.Generator().manual_seed(groups * 10 + steps + n)
    rows, channels = 150, 5
    dim = groups * channels
    inputs = [
        torch.randn(rows, dim, steps, generator=g, dtype=torch.float64),
        0.3 * torch.rand(rows, dim, steps, generator=g, dtype=torch.float64),
        -torch.rand(dim, n, generator=g, dtype=torch.float64) - 0.1,
        torch.randn(rows, groups, n, steps, generator=g, dtype=torch.float64),
        torch.randn(rows, groups, n, steps, generator=g, dtype=torch.float64),
    ]
    results = []
    for fused in (False, True):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = scan._grouped_scan(*leaves, last_only=last_only, fused=fused)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad((out * weights.double()).sum(), leaves)
        results.append((out.detach(), *grads))
    for name, got, want in zip(["y", "u", "delta", "A", "B", "C"], *results[::-1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)
    if steps == 1:
        assert bool((results[1][3] == 0).all())  # dA: zero, not None


@needs_fused
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"global_aggregation": False},  # variant A
        {"cross_client": False},  # variant C
        {"learner_update": "mini-batch", "batch_rows": 7},
    ],
)
def test_fused_server_steps_match_the_eager_server(changes: dict) -> None:
    """pfedseq-scan-backend = 'fused' (auto's choice on a CPU): adapters, calibrations,
    learners and Adam state as with the eager loop, over 1-step windows, partial
    participation (masks) and full windows."""
    eager, fused = (make_server(scan_backend=b, **changes) for b in ("torch", "fused"))
    start = {name: p.detach().clone() for name, p in eager.learners.named_parameters()}
    for server in (eager, fused):
        run_mixed_rounds(server, range(7))
    assert_same_servers(fused, eager, start)


@pytest.mark.parametrize("missing", ["compiler", "writable cache"])
def test_without_a_c_compiler_auto_runs_the_eager_loop_and_fused_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, missing: str
) -> None:
    if missing == "compiler":
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    else:  # a file where the cache directory would be
        (tmp_path / "cache").write_text("")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fresh = functools.lru_cache(maxsize=1)(fused_scan.library.__wrapped__)
    monkeypatch.setattr(fused_scan, "library", fresh)
    assert fused_scan.library() is None and not fused_scan.available()
    u = torch.zeros(2, 3, 4)
    assert not scan.use_fused(u, "auto")
    with pytest.raises(RuntimeError, match="'fused' but the fused scan cannot run here"):
        scan.use_fused(u, "fused")
    server = make_server()  # auto: the eager loop, the same numbers
    run_rounds(server, range(3))
    assert server.round == 3


class CountingLearners:
    """A ``StackedLearners`` that records the rows of every learner call."""

    def __init__(self, inner: StackedLearners) -> None:
        self.inner = inner
        self.calls: list[int] = []

    def __call__(self, params: dict, window: torch.Tensor) -> torch.Tensor:
        self.calls.append(window.shape[0] * window.shape[1])
        return self.inner(params, window)

    def __getattr__(self, name: str):  # noqa: ANN204 - everything else is the inner one's
        return getattr(self.inner, name)


def test_the_automatic_chunk_follows_the_device_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Learner calls per step for a given memory budget: rows per call = budget / (L x per-row
    elements), split over the layers; a budget that holds every row makes one call per pass."""
    from fedfm_flower.learners import chunks
    from fedfm_flower.learners import pfedseq as server_module

    settings = PFedSeqSettings(seq_len=3, warmup_rounds=1)
    adapter = {"blocks.0.lora.weight": torch.zeros(300), "blocks.1.lora.weight": torch.zeros(200)}
    server = PFedSeqServer(settings, adapter, N, seed=0)
    run_rounds(server, range(3))  # a full window of 3 rounds
    counting = CountingLearners(server.stacked)
    server.stacked = counting
    per_row = 3 * server.learners[0].elements_per_row_step(server.fused_scan)
    # eq. 5's calls + the calibrations' calls; eq. 5 runs none when the previous round's
    # calibrations were one call (their graph is held): the first two budgets
    for budget_rows, calls in ((1000, 0 + 1), (300, 0 + 2), (128, 5 + 5)):
        budget = budget_rows * per_row
        monkeypatch.setattr(server_module, "budget_elements", lambda device, b=budget: b)
        counting.calls.clear()
        run_rounds(server, range(3, 4))
        assert len(counting.calls) == calls, counting.calls
        assert max(counting.calls) <= max(budget_rows, server_module.MIN_CHUNK_ROWS)
    # the budgets themselves: CUDA from its free memory, CPU capped by the available RAM
    cuda = chunks.budget_elements(torch.device("cuda"), free_bytes=10 * 2**30)
    assert cuda == int(10 * 2**30 * chunks.CUDA_FREE_FRACTION) // chunks.FLOAT_BYTES
    assert chunks.budget_elements(torch.device("cpu"), free_bytes=2**40) == chunks.CPU_ELEMENTS
    assert chunks.budget_elements(torch.device("cpu"), free_bytes=2**28) == 2**28 // 16


def test_the_held_inference_graph_trains_the_learner_as_a_recomputed_forward() -> None:
    """Round t's surrogate through round t - 1's kept inference graph equals the recomputed
    forward pass: same learner, Adam state and calibrations, bit for bit (same operations on
    the same window and psi); a loaded state or a non-consecutive round recomputes."""
    held, fresh = make_server(warmup_rounds=2), make_server(warmup_rounds=2)
    randomize_output_projections(held.learners)
    fresh.learners.load_state_dict(held.learners.state_dict())
    flags = []
    for t in range(6):
        fresh.held = None  # always recomputes
        updates = random_updates(held, t)
        examples = {c: 10 * (c + 1) for c in updates}
        flags.append(held.step(updates, examples).get("pfedseq-forward-held"))
        stats = fresh.step(updates, examples)
        assert stats.get("pfedseq-forward-held", 0.0) == 0.0
        for name, value in held.learners.state_dict().items():
            assert torch.equal(value, fresh.learners.state_dict()[name]), (t, name)
        assert torch.equal(held.personal, fresh.personal), t
    # round 1 has no history; rounds 2-3 are the warm-up (no calibrations to hold from);
    # rounds 4-6 backpropagate through the previous round's calibrations
    assert flags == [None, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert held.held is not None and held.held.round == 6
    held.load_state_tensors(held.state_tensors())
    assert held.held is None
    mini = make_server(learner_update="mini-batch", batch_rows=5)
    run_rounds(mini, range(4))
    assert mini.held is None


@needs_fused
@pytest.mark.parametrize("last_only", [False, True])
def test_fused_scan_takes_the_softplus_of_delta_like_the_eager_path(last_only: bool) -> None:
    """float64: with delta_bias and delta_softplus the fused loop applies softplus itself
    (raw step sizes on both sides of torch's threshold, 20); outputs and the gradients of u,
    delta, A, B, C, D, z and delta_bias equal the eager path's to 1e-12."""
    g = torch.Generator().manual_seed(7)
    rows, groups, channels, steps, n = 130, 2, 3, 4, 16
    dim = groups * channels
    raw = torch.randn(rows, dim, steps, generator=g, dtype=torch.float64) * 3 - 2
    raw[:, 0, 1] = 25.0  # above the threshold: softplus(x) = x, gradient 1
    inputs = [
        torch.randn(rows, dim, steps, generator=g, dtype=torch.float64),
        raw,
        -torch.rand(dim, n, generator=g, dtype=torch.float64) * 0.2,
        torch.randn(rows, groups, n, steps, generator=g, dtype=torch.float64),
        torch.randn(rows, groups, n, steps, generator=g, dtype=torch.float64),
        torch.randn(dim, generator=g, dtype=torch.float64),
        torch.randn(rows, dim, 1 if last_only else steps, generator=g, dtype=torch.float64),
        torch.randn(dim, generator=g, dtype=torch.float64),
    ]
    results = []
    for backend in ("torch", "fused"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        u, delta, A, B, C, D, z, bias = leaves
        out = scan.selective_scan(
            u,
            delta,
            A,
            B,
            C,
            D,
            z,
            bias,
            delta_softplus=True,
            backend=backend,
            last_only=last_only,
        )
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).double()
        grads = torch.autograd.grad((out * weights).sum(), leaves)
        results.append((out.detach(), *grads))
    names = ["y", "u", "delta", "A", "B", "C", "D", "z", "delta_bias"]
    for name, got, want in zip(names, *results[::-1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)


@needs_fused
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("steps", [1, 6])
def test_fused_conv_equals_the_depthwise_conv1d_values_and_every_gradient(
    width: int, steps: int
) -> None:
    """float64: the fused channels-last conv + SiLU equals ``causal_conv1d_silu`` (F.conv1d)
    per layer, with the gradients of x, the weight and the bias, to 1e-12; more rows than one
    thread takes, so the weight gradients are summed over threads."""
    g = torch.Generator().manual_seed(width * 10 + steps)
    groups, rows, channels = 3, 150, 5
    x = torch.randn(groups, rows, steps, channels, generator=g, dtype=torch.float64)
    weight = torch.randn(groups, channels, width, generator=g, dtype=torch.float64)
    bias = torch.randn(groups, channels, generator=g, dtype=torch.float64)
    weights = torch.randn(groups, rows, steps, channels, generator=g, dtype=torch.float64)

    def reference(x, weight, bias):
        per_layer = [
            scan.causal_conv1d_silu(x[k].transpose(1, 2), weight[k], bias[k], "torch")
            for k in range(groups)
        ]
        return torch.stack(per_layer).transpose(2, 3)

    results = []
    for conv in (reference, fused_scan.fused_conv_silu):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        out = conv(*leaves)
        results.append((out.detach(), *torch.autograd.grad((out * weights).sum(), leaves)))
    for name, got, want in zip(["out", "x", "weight", "bias"], *results[::-1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)


needs_triton = pytest.mark.skipif(
    not (fused_scan.available() and triton_scan.importable()), reason="no C compiler or Triton"
)
TRITON_CASES = [(s, lo, sp) for s in (1, 5) for lo in (False, True) for sp in (False, True)]


@pytest.fixture(scope="module")
def triton_against_c_loop() -> dict:
    """tests/triton_interpreted.py in a fresh process with Triton's interpreter (it must be on
    before Triton is imported): every case's outputs and gradients, Triton's and the C loop's
    largest difference over the C loop's largest magnitude, per tensor."""
    import json
    import os
    import subprocess
    import sys

    script = Path(__file__).with_name("triton_interpreted.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize(("steps", "last_only", "softplus"), TRITON_CASES)
def test_triton_scan_equals_the_c_loop_values_and_every_gradient(
    triton_against_c_loop: dict, steps: int, last_only: bool, softplus: bool
) -> None:
    """The CUDA path's Triton kernels (run by Triton's interpreter on the CPU) give the C
    loop's outputs and the gradients of u, delta, A, B and C within float32 rounding: 1-step
    windows (A's gradient a real zero), the last step only, softplus on both sides of its
    threshold, channels not a power of two (masked), dA summed over rows with atomics."""
    case = triton_against_c_loop[f"{steps}-{int(last_only)}-{int(softplus)}"]
    for name in ("y", "u", "delta", "A", "B", "C"):
        assert case[name] <= 2e-6, (name, case)
        assert case[f"{name}-scale"] > 0 or (name == "A" and steps == 1), (name, case)
    if steps == 1:
        assert case["A-zero"], case  # dA: zero, not None


@needs_triton
def test_the_triton_self_check_passes_on_working_kernels_and_falls_back_on_failing_ones(
    triton_against_c_loop: dict, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """``works``: the kernels pass their check against the eager recurrence (interpreted);
    kernels that fail make it False with a warning, so ``auto`` runs the eager scan."""
    assert triton_against_c_loop["works"]["self-check"] is True

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(triton_scan, "triton_scan", broken)
    with caplog.at_level("WARNING"):
        assert triton_scan.works.__wrapped__(torch.device("cpu")) is False
    assert "PTX assembly failed" in caplog.text and "the eager scan runs" in caplog.text
