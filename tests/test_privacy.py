"""Differential privacy: clipping, fresh noise no one can regenerate, accounting per neighbouring
relation, the release ledger across resumes, refusals, finite settings, and runs end to end."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Message, RecordDict
from run_configs import method_base
from tiny_strategy import TINY, TINY_SPLITS, play, tiny_strategy

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods import MECHANISMS, UNDECLARED
from fedfm_flower.methods.registry import METHODS, method_spec
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.privacy import accountant, mechanism, noise
from fedfm_flower.privacy.support import central_dp_refusal
from fedfm_flower.records import protocol as P
from fedfm_flower.records.durable import json_sha256
from fedfm_flower.records.messages import from_array_record, to_array_record


def tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "adapter.a": scale * torch.randn(6, 5, generator=g),
        "head.weight": scale * torch.randn(3, 7, generator=g),
    }


def delta_norm(sent: dict, received: dict) -> float:
    return math.sqrt(
        sum(float((sent[n].double() - received[n].double()).pow(2).sum()) for n in sent)
    )


# ---------------------------------------------------------------- clipping
def test_clipping_bounds_the_update_norm_over_all_tensors_together() -> None:
    received = tensors(0)
    sent = {n: t + d for (n, t), d in zip(received.items(), tensors(1).values(), strict=True)}
    before = delta_norm(sent, received)
    assert before > 2.0
    clipped = mechanism.clip_update(sent, received, 2.0)
    assert delta_norm(clipped, received) == pytest.approx(2.0, rel=1e-6)
    # one scale for the whole update: every tensor's delta shrinks by the same factor
    for name in sent:
        ratio = (clipped[name] - received[name]) / (sent[name] - received[name])
        torch.testing.assert_close(ratio, torch.full_like(ratio, 2.0 / before), rtol=1e-4, atol=0)
    small = mechanism.clip_update(sent, received, 10 * before)
    assert all(torch.equal(small[n], sent[n]) for n in sent)  # within the bound: unchanged
    with pytest.raises(KeyError, match="not received"):
        mechanism.clip_update({"other": torch.zeros(1)}, received, 1.0)
    with pytest.raises(ValueError, match="clipping norm"):
        mechanism.clip_update(sent, received, 0.0)


# ---------------------------------------------------------------- noise
class NoiseSpy:
    """Wraps ``noise.fresh_gaussian``: the draws of every release, in order (what an observer
    inside the process could see, and the server never can)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.draws: list[dict[str, torch.Tensor]] = []
        real = noise.fresh_gaussian

        def spy(shapes: dict, std: float) -> dict[str, torch.Tensor]:
            drawn = real(shapes, std)
            self.draws.append(drawn)
            return drawn

        monkeypatch.setattr(noise, "fresh_gaussian", spy)


Draw = Callable[[dict[str, tuple[int, ...]]], dict[str, torch.Tensor]]


def seeded_guesses(seed: int, server_round: int, client_id: int | None = None) -> list[Draw]:
    """What an adversary who knows the run config would try: standard normals per tensor, in
    sorted name order, from generators seeded with the run seed, the round and the client id
    (exactly as DP noise was once derived here)."""
    derived = [seed, seed * 1_000_003 + server_round]
    if client_id is not None:
        derived.append((seed * 1_000_003 + server_round) * 10_007 + client_id)

    def torch_draw(value: int) -> Draw:
        def draw(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(value)
            return {
                n: torch.randn(shapes[n], generator=g, dtype=torch.float64) for n in sorted(shapes)
            }

        return draw

    def numpy_draw(value: int) -> Draw:
        def draw(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
            g = np.random.default_rng(value)
            return {n: torch.from_numpy(g.standard_normal(shapes[n])) for n in sorted(shapes)}

        return draw

    return [draw(value) for value in derived for draw in (torch_draw, numpy_draw)]


def std_tolerance(count: int) -> float:
    """Relative tolerance for the sample std of ``count`` fresh normal draws: 6 of its standard
    errors (1 / sqrt(2 count)), so a correct mechanism fails about twice in a billion runs (the
    noise comes from OS entropy: no seed makes a test's draws repeat)."""
    return 6.0 / math.sqrt(2.0 * count)


def test_the_noise_has_the_set_standard_deviation_and_is_fresh_every_release() -> None:
    std = mechanism.noise_std(noise_multiplier=1.5, clipping_norm=0.4, num_sampled=3)
    assert std == pytest.approx(0.2)
    zeros = {"a": torch.zeros(400, 500), "b": torch.zeros(1000)}
    torch.manual_seed(0)
    np.random.seed(0)
    noised = mechanism.add_gaussian_noise(zeros, std)
    sample = torch.cat([t.flatten() for t in noised.values()]).double()
    assert sample.numel() == 201_000
    assert float(sample.std()) == pytest.approx(std, rel=std_tolerance(sample.numel()))
    assert abs(float(sample.mean())) < 5 * std / math.sqrt(sample.numel())
    # the same global seeds again: other noise (no seed, global or run, reaches it)
    torch.manual_seed(0)
    np.random.seed(0)
    again = mechanism.add_gaussian_noise(zeros, std)
    for name in zeros:
        correlation = np.corrcoef(again[name].flatten(), noised[name].flatten())[0, 1]
        # independent draws: within 6 standard errors (1 / sqrt(n)) of 0; the same ones give 1
        assert abs(correlation) < 6 / math.sqrt(zeros[name].numel()), name
    assert mechanism.add_gaussian_noise(zeros, 0.0)["a"] is zeros["a"]  # sigma 0: no draw
    with pytest.raises(ValueError, match="finite"):
        mechanism.add_gaussian_noise(zeros, math.nan)


def test_each_release_keys_a_fresh_generator_with_128_bits_of_os_entropy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import secrets

    asked: list[int] = []
    real = secrets.randbits
    monkeypatch.setattr(secrets, "randbits", lambda bits: asked.append(bits) or real(bits))
    first = noise.fresh_gaussian({"x": (4,)}, 1.0)
    second = noise.fresh_gaussian({"x": (4,)}, 1.0)
    assert asked == [128, 128]
    assert not torch.equal(first["x"], second["x"])
    # why not torch.Generator: it keeps 32 bits of a seed, so an entropy key would not help
    low = torch.randn(3, generator=torch.Generator().manual_seed(5))
    high = torch.randn(3, generator=torch.Generator().manual_seed(5 + 2**32))
    assert torch.equal(low, high)


# ---------------------------------------------------------------- accounting
def rdp_epsilon(noise_multiplier: float, rounds: int, delta: float, orders: list[float]) -> float:
    """The Gaussian mechanism's RDP (alpha T / (2 sigma^2)) converted to (epsilon, delta) with
    Balle et al. (2020)'s bound, minimised over ``orders``: written out here, not Opacus'."""
    best = math.inf
    for alpha in orders:
        rdp = alpha * rounds / (2 * noise_multiplier**2)
        eps = rdp + math.log1p(-1 / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1)
        best = min(best, eps)
    return best


@pytest.mark.parametrize(("sigma", "rounds"), [(1.0, 20), (2.0, 100), (0.8, 1)])
def test_the_epsilon_is_opacus_rdp_accountants_and_the_gaussian_mechanisms(
    sigma: float, rounds: int
) -> None:
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    got = accountant.epsilon_spent(sigma, rounds, 1e-5)
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = compute_rdp(q=1.0, noise_multiplier=sigma, steps=rounds, orders=orders)
    library, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert got == pytest.approx(library, rel=1e-12)
    assert got == pytest.approx(rdp_epsilon(sigma, rounds, 1e-5, orders), rel=1e-9)
    assert accountant.epsilon_spent(sigma, rounds + 1, 1e-5) > got  # it only grows
    assert accountant.epsilon_spent(sigma, 0, 1e-5) == 0.0
    assert accountant.epsilon_spent(0.0, rounds, 1e-5) == math.inf


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of a mu-GDP mechanism (Dong, Roth and Su 2019; T Gaussian
    releases of sensitivity D and noise std s compose to mu = sqrt(T) D / s): the root of
    delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) (Balle and Wang 2018), by
    bisection. An accountant independent of RDP; any valid bound lies above it."""
    from statistics import NormalDist

    phi = NormalDist().cdf
    low, high = 0.0, 200.0
    for _ in range(200):
        eps = (low + high) / 2
        if phi(mu / 2 - eps / mu) - math.exp(eps) * phi(-mu / 2 - eps / mu) > delta:
            low = eps
        else:
            high = eps
    return high


@pytest.mark.parametrize(("sigma", "releases"), [(2.0, 2), (1.0, 20), (4.0, 50)])
def test_local_dp_epsilon_is_stated_for_sensitivity_2c(sigma: float, releases: int) -> None:
    """Under local DP two datasets of one client can give clipped updates 2C apart: epsilon is
    the Gaussian mechanism's at sigma / 2, a bound above the exact epsilon at sensitivity 2C,
    where the sensitivity-C figure falls below it (it would understate the loss)."""
    local = ExperimentConfig().replace(
        method="fedavg", dp="local", dp_noise_multiplier=sigma, dp_clipping_norm=0.3
    )
    central = local.replace(dp="central")
    reported = accountant.epsilon_of(local, releases)
    from opacus.accountants import RDPAccountant

    orders = RDPAccountant.DEFAULT_ALPHAS
    assert reported == pytest.approx(rdp_epsilon(sigma / 2, releases, 1e-5, orders), rel=1e-9)
    exact_2c = exact_gaussian_epsilon(math.sqrt(releases) * 2 / sigma, 1e-5)
    assert exact_2c <= reported < 1.25 * exact_2c
    assert accountant.epsilon_spent(sigma, releases, 1e-5) < exact_2c  # sensitivity C: too low
    assert accountant.epsilon_of(central, releases) == accountant.epsilon_spent(
        sigma, releases, 1e-5
    )
    assert exact_gaussian_epsilon(math.sqrt(releases) / sigma, 1e-5) <= accountant.epsilon_of(
        central, releases
    )
    if (sigma, releases) == (2.0, 2):  # Google's dp-accounting RDP accountant: 7.08
        assert reported == pytest.approx(7.08, abs=0.005)
    assert accountant.release_metrics(local, releases, 0.6)["dp-sensitivity"] == 0.6
    assert accountant.release_metrics(central, releases, 0.6)["dp-sensitivity"] == 0.3


# ---------------------------------------------------------------- who can take it
def _declaring(mechanism: str, supported: bool) -> list[str]:
    """The registry's methods that declare ``mechanism`` supported (or refused)."""
    return [
        name
        for name, spec in METHODS.items()
        if (spec.capabilities.refusal(mechanism) is None) == supported
    ]


def test_every_method_declares_its_capabilities_and_refusals_say_why() -> None:
    """No method is left with the undeclared default; every refusal is a reason, not a flag."""
    for name, spec in METHODS.items():
        assert spec.capabilities is not UNDECLARED, name
        for kind in MECHANISMS:
            reason = spec.capabilities.refusal(kind)
            assert reason is None or len(reason.split()) >= 5, (name, kind, reason)
    assert {"fedavg", "local"} <= set(_declaring("central-dp", True))
    assert {"pfedseq", "pfedpg"} <= set(_declaring("local-dp", True))
    assert {"pfedseq", "tap", "centralized"} <= set(_declaring("central-dp", False))


@pytest.mark.parametrize("method", _declaring("central-dp", True))
def test_a_method_that_declares_central_dp_has_the_noised_average(method: str) -> None:
    """Its strategy is FedAvg's, the one with the clipped, noised average."""
    from fedfm_flower.methods.halves import strategy_class
    from strategies.fedavg import FedAvgStrategy

    assert issubclass(strategy_class(method), FedAvgStrategy)
    config = ExperimentConfig.from_run_config({**method_base(method), "dp": "central"})
    assert central_dp_refusal(config) is None


@pytest.mark.parametrize("method", _declaring("central-dp", False))
def test_a_method_that_cannot_take_central_dp_is_refused_at_start(method: str) -> None:
    with pytest.raises(ConfigError, match="'dp'") as refused:
        ExperimentConfig.from_run_config({**method_base(method), "dp": "central"})
    assert method_spec(method).capabilities.central_dp in str(refused.value)
    assert central_dp_refusal(SimpleNamespace(method=method, dp="central")) is not None


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("dp", "global", "allowed: none, central, local"),
        ("dp-clipping-norm", 0.0, "must be > 0"),
        ("dp-noise-multiplier", -1.0, "must be >= 0"),
        ("dp-delta", 1.0, "must lie in"),
    ],
)
def test_bad_privacy_settings_name_the_key(key: str, value: object, rule: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'.*{rule}"):
        ExperimentConfig.from_run_config({"method": "fedavg", key: value})


PRIVACY_FLOATS = (
    "dp-clipping-norm",
    "dp-noise-multiplier",
    "dp-delta",
    "dp-target-epsilon",
    "secagg-num-shares",
    "secagg-threshold",
    "secagg-clipping-range",
    "secagg-max-weight",
)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "inf"])
@pytest.mark.parametrize("key", PRIVACY_FLOATS)
def test_privacy_settings_refuse_nan_and_infinity(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"'{key}' = .* must be a finite number"):
        ExperimentConfig.from_run_config({"method": "fedavg", "dp": "local", key: value})
    name = key.replace("-", "_")
    with pytest.raises(ConfigError, match=f"'{key}' = .* must be a finite number"):
        ExperimentConfig().replace(**{name: float(value)})  # built in code: validate() checks


def test_every_float_key_refuses_nan_and_infinity_naming_it() -> None:
    """All keys, the methods' own (pfedseq-lr, ...) included."""
    floats = [k for k, v in ExperimentConfig().to_run_config().items() if isinstance(v, float)]
    assert len(floats) > 30 and "pfedseq-lr" in floats and "round-timeout" in floats
    for key in floats:
        for value in (math.nan, math.inf):
            with pytest.raises(ConfigError, match=f"'{key}' = {value} .*finite"):
                ExperimentConfig.from_run_config({key: value})
    ExperimentConfig.from_run_config({"lr": 3, "round-timeout": 1e6})  # finite values pass


# ---------------------------------------------------------------- a run
def fedavg_grid(small: dict, mode: str, clip: float, sigma: float, delta: float):  # noqa: ANN201
    """(run config, in-process grid) of a 4-client FedAvg run under ``dp = mode``."""
    from client_apps.app import app as client_app
    from server_apps.inprocess import InProcessGrid, simulation_node_configs

    run_config = {
        **ExperimentConfig().to_run_config(),
        **small,
        "method": "fedavg",
        "run-name": mode,
        "dp": mode,
        "dp-clipping-norm": clip,
        "dp-noise-multiplier": sigma,
        "dp-delta": delta,
    }
    return run_config, InProcessGrid(client_app, run_config, simulation_node_configs(4))


def test_a_central_dp_run_clips_what_travels_noises_the_average_and_reports_epsilon(
    small_run_config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FedAvg, 4 clients, 2 rounds: each training reply's update is within C (checked on the
    reply as it leaves the client); a client that sends a 100x update is clipped again by the
    server; round 2's global tensors are round 1's plus the clipped updates' sum over the 4
    sampled clients plus exactly the noise round 1 drew (std sigma C / 4), which no generator
    seeded from the run config reproduces; every round records the epsilon of Opacus'
    accountant at sensitivity C, and the summary the last one."""
    clip, sigma, delta = 0.05, 0.7, 1e-4
    spy = NoiseSpy(monkeypatch)
    run_config, grid = fedavg_grid(small_run_config, "central", clip, sigma, delta)
    replies: dict[str, dict[str, torch.Tensor]] = {}  # message id -> the reply's arrays used

    def hook(client_id: int, reply: Message) -> Message:
        message = grid.sent[-1]  # the grid calls the hook on the reply to its last message
        if message.metadata.message_type != "train" or reply.has_error():
            return reply
        arrays = from_array_record(reply.content[P.ARRAYS])
        received = from_array_record(message.content[P.ARRAYS])
        assert delta_norm(arrays, received) <= clip * (1 + 1e-5)  # as it leaves the client
        if client_id == 3:  # a client that does not clip: 100x its update
            arrays = {n: received[n] + 100 * (t - received[n]) for n, t in arrays.items()}
            content = RecordDict(
                {P.ARRAYS: to_array_record(arrays), P.METRICS: reply.content[P.METRICS]}
            )
            reply = Message(content, reply_to=message)
        replies[message.metadata.message_id] = arrays
        return reply

    grid.reply_hook = hook
    from server_apps.runner import run_experiment

    summary = run_experiment(grid, ExperimentConfig.from_run_config(run_config))

    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    rounds = {int(m.metadata.group_id) for m in train}
    assert rounds == {1, 2} and len(train) == 8
    assert len(replies) == 8
    # round 2's payload, recomputed from round 1's payload and replies
    first = [m for m in train if m.metadata.group_id == "1"]
    start = from_array_record(first[0].content[P.ARRAYS])
    total = {n: torch.zeros_like(t, dtype=torch.float64) for n, t in start.items()}
    for message in first:
        clipped = mechanism.clip_update(replies[message.metadata.message_id], start, clip)
        for n in total:
            total[n] += clipped[n].double() - start[n].double()
    second = from_array_record(
        next(m for m in train if m.metadata.group_id == "2").content[P.ARRAYS]
    )
    std = sigma * clip / 4
    assert len(spy.draws) == 2  # one release per round, each its own draw
    drawn = torch.cat([spy.draws[0][n].flatten() for n in sorted(start)])
    ordered = torch.cat(
        [(second[n].double() - start[n].double() - total[n] / 4).flatten() for n in sorted(start)]
    )
    assert ordered.numel() > 100
    np.testing.assert_allclose(ordered.numpy(), drawn.numpy(), atol=1e-6 * max(1.0, std))
    assert float(ordered.std()) == pytest.approx(std, rel=std_tolerance(ordered.numel()))
    # an adversary who knows the run config regenerates "the noise" from the seed and round:
    # what is left is still noise of the full std, not the clipped mean it wanted
    shapes = {n: tuple(t.shape) for n, t in start.items()}
    for guess in seeded_guesses(0, 1):
        regenerated = guess(shapes)
        left = ordered - torch.cat([regenerated[n].flatten() for n in sorted(start)]) * std
        assert float(left.std()) > 0.8 * std

    lines = (Path(run_config["output-dir"]) / "central" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for t, record in enumerate(records, start=1):
        assert record["server"]["dp-epsilon"] == pytest.approx(
            accountant.epsilon_spent(sigma, t, delta)
        )
        assert record["server"]["dp-noise-std"] == pytest.approx(std)
        assert record["server"]["dp-sensitivity"] == pytest.approx(clip)
    assert summary["dp-epsilon"] == pytest.approx(accountant.epsilon_spent(sigma, 2, delta))
    assert summary["dp-releases"] == 2
    assert summary["dp-noise"] == "os-entropy" and summary["dp-sensitivity"] == clip
    ledger = json.loads((Path(run_config["output-dir"]) / "central" / "privacy.json").read_text())
    seal = ledger.pop("sha256")  # durable.sealed_json: a flipped bit is refused, not read
    assert ledger == {"mode": "central", "noise": "os-entropy", "releases": [1, 2]}
    assert seal == json_sha256(ledger)


# ---------------------------------------------------------------- local DP
def test_local_dp_clips_then_adds_noise_of_sigma_c_to_each_coordinate() -> None:
    received = {"a": torch.zeros(300, 400), "b": torch.zeros(50)}
    g = torch.Generator().manual_seed(5)
    sent = {n: 3.0 * torch.randn(t.shape, generator=g) for n, t in received.items()}
    clip, sigma = 2.0, 0.5
    out = mechanism.privatize_locally(sent, received, clip, sigma)
    clipped = mechanism.clip_update(sent, received, clip)
    noise = torch.cat([(out[n].double() - clipped[n].double()).flatten() for n in sorted(out)])
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=std_tolerance(noise.numel()))
    without_noise = mechanism.privatize_locally(sent, received, clip, 0.0)
    assert all(torch.equal(without_noise[n], clipped[n]) for n in sent)


def test_a_client_that_sends_updates_is_clipped_and_noised_around_zero(tmp_path: Path) -> None:
    """pFedSeq's and pFedPG's clients send Delta itself: the base is zero, not what they got."""
    from client_apps.app import _privatized
    from client_apps.updates import UpdateClient

    config = ExperimentConfig().replace(
        method="pfedpg", dp="local", dp_clipping_norm=0.1, dp_noise_multiplier=0.0, seed=3
    )
    runtime = SimpleNamespace(config=config, identity=SimpleNamespace(client_id=2))
    update = {"adapter.a": torch.full((10,), 1.0)}
    received = {"adapter.a": torch.full((10,), 50.0)}
    sent = _privatized(runtime, UpdateClient(), update, received)
    assert delta_norm(sent, {"adapter.a": torch.zeros(10)}) == pytest.approx(0.1, rel=1e-6)
    noisy = config.replace(dp_noise_multiplier=1.0)
    runtime.config = noisy
    first = _privatized(runtime, UpdateClient(), update, received)
    again = _privatized(runtime, UpdateClient(), update, received)
    assert not torch.equal(first["adapter.a"], again["adapter.a"])  # fresh noise each time


@pytest.mark.parametrize("dp", ["central", "local"])
def test_a_post_training_reply_with_tensors_under_dp_is_refused_on_the_client(dp: str) -> None:
    """A post-training round is no release (FedDPA-F and TAP send nothing up in it): a method
    whose post-training round sends tensors under ``dp`` fails on the client, naming it, rather
    than send them unprotected; without tensors the reply goes out."""
    from flwr.app import ConfigRecord

    from client_apps.app import _train_content
    from fedfm_flower.tasks.base import TrainStats

    config = ExperimentConfig().replace(method="fedavg", dp=dp)  # standing in for a method
    post = ConfigRecord({P.PHASE: "post-training", P.SERVER_ROUND: 3})
    store = SimpleNamespace(loaded_round=2, loaded_digest="d")
    runtime = SimpleNamespace(config=config, store=store, identity=SimpleNamespace(client_id=1))
    sends = {"adapter.local.a": torch.ones(3)}

    class PostTraining:
        def post_train(self, runtime, received, server_round):  # noqa: ANN001, ANN202
            return dict(sends), TrainStats(0.5, {}, 4, 1, 0.1)

        def data_size(self, runtime):  # noqa: ANN001, ANN202
            return 4

    context = SimpleNamespace(node_config={})
    with pytest.raises(RuntimeError, match="'fedavg' sends 1 tensors in its post-training"):
        _train_content(runtime, PostTraining(), context, post, {}, 0.0)
    sends.clear()
    content = _train_content(runtime, PostTraining(), context, post, {}, 0.0)
    assert from_array_record(content[P.ARRAYS]) == {}


@pytest.mark.parametrize("method", list(METHODS))
def test_local_dp_is_taken_or_refused_at_start_as_the_method_declares(method: str) -> None:
    from fedfm_flower.privacy.support import local_dp_refusal

    declared = method_spec(method).capabilities.local_dp
    assert local_dp_refusal(SimpleNamespace(method=method)) == declared
    if declared is None:
        ExperimentConfig.from_run_config({**method_base(method), "dp": "local"})
    else:
        with pytest.raises(ConfigError, match="'dp'") as refused:
            ExperimentConfig.from_run_config({**method_base(method), "dp": "local"})
        assert declared in str(refused.value)


def test_the_capability_table_in_the_docs_is_generated_from_the_methods() -> None:
    """docs/privacy.md's table is ``capability_table()`` (regenerate: ``python -m
    fedfm_flower.privacy.support --write docs/privacy.md``); every method is in it."""
    from fedfm_flower.privacy.support import capability_table, with_table

    docs = (Path(__file__).resolve().parent.parent / "docs" / "privacy.md").read_text()
    assert with_table(docs) == docs, "docs/privacy.md's capability table is stale"
    table = capability_table()
    for name in METHODS:
        assert table.count(f" {name},") + table.count(f" {name} |") == 1, name
    with pytest.raises(ValueError, match="capabilities:begin"):
        with_table("no markers here")


def test_a_local_dp_run_sends_noised_clipped_updates_and_reports_epsilon(
    small_run_config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FedAvg, 4 clients, 2 rounds: each training reply minus what the client received, minus
    the noise that client drew, is within C, while the server, regenerating the noise from
    the run config, is left far from it, and the reply carries no digest of the personal state;
    every round records the epsilon of that many Gaussian releases at sensitivity 2C."""
    clip, sigma, delta = 0.05, 2.0, 1e-5
    run_config, grid = fedavg_grid(small_run_config, "local", clip, sigma, delta)
    spy = NoiseSpy(monkeypatch)
    checked = []

    def hook(client_id: int, reply: Message) -> Message:
        message = grid.sent[-1]
        if message.metadata.message_type == "train" and not reply.has_error():
            sent = from_array_record(reply.content[P.ARRAYS])
            received = from_array_record(message.content[P.ARRAYS])
            server_round = int(message.metadata.group_id)
            drawn = spy.draws[-1]  # this client's release, drawn just before its reply
            update = {n: sent[n].double() - drawn[n] for n in sent}
            assert delta_norm(update, received) <= clip * (1 + 1e-4)
            assert delta_norm(sent, received) > 10 * clip  # the noise is there
            metrics = reply.content[P.METRICS]  # no fingerprint of the personal state
            assert P.STATE_ROUND in metrics and P.STATE_DIGEST not in metrics
            shapes = {n: tuple(t.shape) for n, t in sent.items()}
            for guess in seeded_guesses(0, server_round, client_id):
                regenerated = guess(shapes)
                recovered = {n: sent[n].double() - regenerated[n] * sigma * clip for n in sent}
                assert delta_norm(recovered, received) > 10 * clip  # not the update
            checked.append(client_id)
        return reply

    grid.reply_hook = hook
    from server_apps.runner import run_experiment

    summary = run_experiment(grid, ExperimentConfig.from_run_config(run_config))
    assert sorted(checked) == [0, 0, 1, 1, 2, 2, 3, 3]
    lines = (Path(run_config["output-dir"]) / "local" / "metrics.jsonl").read_text().splitlines()
    for t, line in enumerate(lines, start=1):
        server = json.loads(line)["server"]
        # sensitivity 2C: the Gaussian mechanism at noise multiplier sigma C / 2C = sigma / 2
        epsilon = accountant.epsilon_spent(sigma / 2, t, delta)
        assert server["dp-epsilon"] == pytest.approx(epsilon)
        assert server["dp-noise-std"] == pytest.approx(sigma * clip)
        assert server["dp-sensitivity"] == pytest.approx(2 * clip)
    assert summary["dp-epsilon"] == pytest.approx(accountant.epsilon_spent(sigma / 2, 2, delta))
    assert summary["dp-sensitivity"] == pytest.approx(2 * clip)
    assert "replaced" in summary["dp-neighbouring"]


def test_a_target_epsilon_sets_the_noise_multiplier_that_spends_it_over_the_rounds() -> None:
    config = ExperimentConfig().replace(
        method="fedavg", dp="central", dp_target_epsilon=8.0, num_server_rounds=20
    )
    sigma = accountant.noise_multiplier(config)
    spent = accountant.epsilon_spent(sigma, 20, config.dp_delta)
    assert 8.0 - 0.01 <= spent <= 8.0  # Opacus' tolerance, from below
    assert accountant.epsilon_spent(sigma * 0.98, 20, config.dp_delta) > 8.0  # the smallest
    assert accountant.noise_multiplier(config.replace(dp_target_epsilon=0.0)) == 1.0
    local = config.replace(dp="local")  # sensitivity 2C: twice the noise for the same epsilon
    assert accountant.noise_multiplier(local) == pytest.approx(2 * sigma)
    assert 8.0 - 0.01 <= accountant.epsilon_of(local, 20) <= 8.0
    with pytest.raises(ConfigError, match="'dp-target-epsilon'"):
        config.replace(dp_target_epsilon=-1.0).validate()


def test_a_resumed_central_dp_strategy_counts_on_with_fresh_noise() -> None:
    """Three rounds straight, and two rounds, a checkpoint, a fresh strategy restored from it
    and the third round: the same count and epsilon, other noise (it is fresh); the checkpoint
    records the ledger and its noise source, and a DP checkpoint without one is refused."""
    config = ExperimentConfig(
        method="fedavg", num_clients=3, dp="central", dp_clipping_norm=0.5, seed=4
    )
    straight, grid = tiny_strategy(config)
    last = play(straight, grid, [1, 2, 3])
    first, grid = tiny_strategy(config)
    play(first, grid, [1, 2])
    tensors, meta = first.state_dict()
    assert meta["privacy"] == {"mode": "central", "noise": "os-entropy", "releases": [1, 2]}
    assert set(tensors) == {f"global.{n}" for n in TINY}  # the count lives in the ledger
    resumed, grid = tiny_strategy(config)
    resumed.load_state_dict(tensors, meta)
    again = play(resumed, grid, [3])
    assert again == last and last["dp-releases"] == 3.0
    assert "update-norm-median" not in last  # not a statistic to release under DP
    assert not torch.equal(
        resumed.global_tensors["adapter.a"], straight.global_tensors["adapter.a"]
    )
    for stale in (
        {k: v for k, v in meta.items() if k != "privacy"},
        {**meta, "privacy": {**meta["privacy"], "noise": "seed"}},
    ):
        with pytest.raises(ValueError, match="regenerate"):
            tiny_strategy(config)[0].load_state_dict(tensors, stale)
    with pytest.raises(ValueError, match="dp = 'central', not 'local'"):
        tiny_strategy(config.replace(dp="local"))[0].load_state_dict(tensors, meta)


@pytest.mark.parametrize("mode", ["central", "local"])
def test_a_release_after_the_last_checkpoint_counts_again_on_resume(
    small_run_config: dict, mode: str
) -> None:
    """A run whose round 2 released and then lost its checkpoint (a crash in between): the
    ledger on disk holds the release, the resumed run redoes round 2 with fresh noise, and
    the accountant counts three releases (1, 2, 2), not two."""
    from server_apps.runner import run_experiment

    clip, sigma, delta = 0.05, 1.0, 1e-5
    run_config, grid = fedavg_grid(small_run_config, mode, clip, sigma, delta)
    run_experiment(grid, ExperimentConfig.from_run_config(run_config))
    run_dir = Path(run_config["output-dir"]) / mode
    for path in (run_dir / "checkpoints").glob("round_00002.*"):
        path.unlink()
    ledger = run_dir / "privacy.json"
    assert json.loads(ledger.read_text())["releases"] == [1, 2]
    resumed_config = ExperimentConfig.from_run_config({**run_config, "resume": True})
    _, grid = fedavg_grid(small_run_config, mode, clip, sigma, delta)
    summary = run_experiment(grid, resumed_config)
    assert json.loads(ledger.read_text())["releases"] == [1, 2, 2]
    assert summary["dp-releases"] == 3
    assert summary["dp-epsilon"] == pytest.approx(accountant.epsilon_of(resumed_config, 3))
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["server"]["dp-releases"] for r in rounds] == [1.0, 3.0]


def test_without_dp_the_median_update_norm_is_reported() -> None:
    """Client c's update is (c + 1) in each of the 14 shared entries: norm (c + 1) sqrt(14)."""
    config = ExperimentConfig(method="fedavg", num_clients=3)
    strategy, grid = tiny_strategy(config)
    metrics = play(strategy, grid, [1])
    assert metrics["update-norm-median"] == pytest.approx(2 * math.sqrt(14))


def test_resuming_a_dp_run_without_a_fresh_noise_ledger_is_refused_before_start(
    tmp_path: Path,
) -> None:
    """The launcher's preflight (exit 2): a DP checkpoint without a ledger of fresh noise (its
    releases could be regenerated from the seed), or an unreadable privacy.json, stops a
    resume; a checkpoint and ledger written by a DP run pass."""
    from fedfm_flower.records.results import RunDirectory
    from fedfm_flower.simulation.preflight import PreflightError, check_run

    config = ExperimentConfig().replace(
        method="fedavg",
        dp="central",
        num_clients=4,
        run_name="dp",
        output_dir=str(tmp_path),
        resume=True,
    )
    run = RunDirectory(tmp_path / "dp")
    run.checkpoint_dir.mkdir(parents=True)
    strategy, _ = tiny_strategy(config.replace(num_clients=3, resume=False))
    tensors, meta = strategy.state_dict()
    stale = {k: v for k, v in meta.items() if k != "privacy"}
    run.save_checkpoint(1, tensors, {"strategy": stale}, keep=2)
    with pytest.raises(PreflightError, match="checkpoint of round 1: .*regenerate"):
        check_run(config, 4)
    run.save_checkpoint(2, tensors, {"strategy": meta}, keep=2)
    assert any("after round 2" in note for note in check_run(config, 4).notes)
    (run.path / "privacy.json").write_text('{"mode": "central", "noise": "os-entropy", "rel')
    with pytest.raises(PreflightError, match="unusable privacy ledger"):
        check_run(config, 4)


# ---------------------------------------------------------------- the privacy parts
@pytest.mark.parametrize(
    ("settings", "accounting", "exchange", "update"),
    [
        ({}, "ReleaseAccounting", "PlainExchange", "WeightedAverage"),
        ({"dp": "central"}, "CentralReleases", "PlainExchange", "DPFedAvg"),
        ({"dp": "local"}, "LocalReleases", "PlainExchange", "WeightedAverage"),
        ({"secagg": True}, "ReleaseAccounting", "SecAggExchange", "SecureMeanUpdate"),
        ({"secagg": True, "dp": "local"}, "LocalReleases", "SecAggExchange", "SecureMeanUpdate"),
    ],
)
def test_fedavg_is_composed_of_the_privacy_parts_its_run_config_asks_for(
    settings: dict, accounting: str, exchange: str, update: str
) -> None:
    """The release accounting (base), the exchange and FedAvg's update are chosen at build;
    without DP nothing is checkpointed of the releases and the runner keeps no ledger."""
    config = ExperimentConfig.from_run_config({"method": "fedavg", "num-clients": 3, **settings})
    strategy, _ = tiny_strategy(config)
    parts = (strategy.privacy, strategy.exchanger, strategy.update)
    assert [type(part).__name__ for part in parts] == [accounting, exchange, update]
    assert (strategy.releases is None) == ("dp" not in settings)
    assert ("privacy" in strategy.state_dict()[1]) == ("dp" in settings)


@pytest.mark.parametrize(
    ("method", "mechanism"),
    [
        (name, mechanism)
        for name, spec in METHODS.items()
        for mechanism in ("central-dp", "local-dp")
        if spec.capabilities.refusal(mechanism) is None
    ],
)
def test_every_method_that_takes_dp_is_composed_of_its_part(method: str, mechanism: str) -> None:
    """Derived from ``MethodSpec.capabilities``: a method that takes central DP runs
    DP-FedAvg's update (on FedAvg's strategy), one that takes local DP counts local releases
    (the base's part, whatever the strategy; SecAgg+: ``tests/test_secagg.py``)."""
    from fedfm_flower.methods.halves import strategy_class
    from strategies.fedavg import FedAvgStrategy
    from strategies.parts.accounting import LocalReleases, accounting_for
    from strategies.parts.averaging import DPFedAvg

    mode = "central" if mechanism == "central-dp" else "local"
    fit = TINY_SPLITS.get(method, {})
    config = ExperimentConfig.from_run_config({**method_base(method), "dp": mode, **fit})
    if not issubclass(strategy_class(method), FedAvgStrategy):  # pFedSeq, pFedPG
        assert mode == "local" and isinstance(accounting_for(config), LocalReleases), method
        return
    strategy, _ = tiny_strategy(config.replace(num_clients=3))
    if mode == "central":
        assert isinstance(strategy.update, DPFedAvg), (method, strategy.update)
    else:
        assert isinstance(strategy.privacy, LocalReleases), (method, strategy.privacy)


def _attributes_and_imports(path: Path) -> tuple[set[str], set[str]]:
    """The attribute names a module reads and the modules (and names) it imports."""
    import ast

    tree = ast.parse(path.read_text())
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    imports: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imports |= {f"{node.module}.{alias.name}" for alias in node.names}
    return attributes, imports


def test_the_round_loop_and_the_base_name_no_dp_mode_and_no_secagg() -> None:
    """The runner calls configure_round, exchange and aggregate_round whatever the privacy
    parts are: it neither imports SecAgg+ nor reads the dp or secagg settings; the strategy
    base reads neither (its parts were chosen at build)."""
    root = Path(__file__).resolve().parent.parent
    for module in ("server_apps/runner.py", "strategies/base.py"):
        attributes, imports = _attributes_and_imports(root / module)
        assert not {"dp", "secagg", "secure_exchange", "secure_round"} & attributes, module
        assert not [name for name in imports if "secagg" in name], module
    attributes, _ = _attributes_and_imports(root / "server_apps/runner.py")
    assert {"configure_round", "exchange", "aggregate_round"} <= attributes


def test_the_dp_fedavg_part_equals_a_hand_computation_with_known_noise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three replies, five clients sampled: global + (sum of the updates clipped to C) / 5 +
    the drawn noise, whose std is sigma C / 5; the release is counted and its metrics are
    the accountant's."""
    from strategies.parts.accounting import CentralReleases
    from strategies.parts.averaging import DPFedAvg
    from strategies.parts.exchange import RoundInputs
    from strategies.parts.replies import ClientReply

    config = ExperimentConfig(method="fedavg", dp="central", dp_clipping_norm=0.5, seed=3)
    stds: list[float] = []

    def known(shapes: dict, std: float) -> dict[str, torch.Tensor]:
        stds.append(std)
        return {n: torch.full(shapes[n], 0.01, dtype=torch.float64) for n in sorted(shapes)}

    monkeypatch.setattr(noise, "fresh_gaussian", known)
    g = torch.Generator().manual_seed(11)
    tensors = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(2, generator=g)}
    scales = (0.05, 1.0, 3.0)  # the first update is within C, the others are clipped
    sent = [
        {n: t + scale * torch.randn(t.shape, generator=g) for n, t in tensors.items()}
        for scale in scales
    ]
    replies = [ClientReply(c, 100 + c, arrays, 10, {}) for c, arrays in enumerate(sent)]
    releases = CentralReleases(config)
    updated, metrics = DPFedAvg(config, releases).apply(7, tensors, replies, RoundInputs(5))

    expected = {n: t.double().clone() for n, t in tensors.items()}
    for arrays in sent:
        deltas = {n: arrays[n].double() - tensors[n].double() for n in tensors}
        norm = math.sqrt(sum(float((d**2).sum()) for d in deltas.values()))
        for n, d in deltas.items():
            expected[n] += d * min(1.0, 0.5 / norm) / 5
    sigma = accountant.noise_multiplier(config)
    assert stds == [pytest.approx(sigma * 0.5 / 5)]
    for n, t in tensors.items():
        assert updated[n].dtype == t.dtype
        assert torch.allclose(updated[n].double(), expected[n] + 0.01, atol=1e-6), n
    assert releases.ledger.rounds == [7]
    assert metrics == accountant.release_metrics(config, 1, stds[0])


def test_local_dp_counts_one_release_per_dispatched_round_across_a_resume() -> None:
    """Local DP counts a release when a round's training messages are built: three rounds
    straight, and two rounds, a checkpoint, a restored strategy and the third, both count
    [1, 2, 3] and report the same epsilon; each round's metrics carry the count so far."""
    config = ExperimentConfig(method="fedavg", num_clients=3, dp="local", dp_clipping_norm=0.5)
    straight, grid = tiny_strategy(config)
    last = play(straight, grid, [1, 2, 3])
    first, grid = tiny_strategy(config)
    assert play(first, grid, [1])["dp-releases"] == 1.0
    play(first, grid, [2])
    tensors, meta = first.state_dict()
    assert meta["privacy"] == {"mode": "local", "noise": "os-entropy", "releases": [1, 2]}
    resumed, grid = tiny_strategy(config)
    resumed.load_state_dict(tensors, meta)
    again = play(resumed, grid, [3])
    assert resumed.releases is not None and resumed.releases.rounds == [1, 2, 3]
    assert again == last and last["dp-releases"] == 3.0
    assert last["dp-epsilon"] == accountant.epsilon_of(config, 3)
    assert last["dp-noise-std"] == accountant.noise_multiplier(config) * 0.5


def _rejected_round(strategy, grid, server_round: int) -> dict:  # noqa: ANN001
    """A round whose every reply is rejected (NaN in what the client sent); its server
    metrics."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

    replies = []
    for m in strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid):
        client = int(m.content[P.CONFIG][P.CLIENT_ID])
        sent = {n: a + float("nan") for n, a in from_array_record(m.content[P.ARRAYS]).items()}
        metrics = MetricRecord({P.CLIENT_ID: client, P.NUM_EXAMPLES: 5})
        content = RecordDict({P.ARRAYS: to_array_record(sent), P.METRICS: metrics})
        replies.append(Message(content, reply_to=m))
    return strategy.aggregate_round(server_round, None, replies).server_metrics


def test_central_dp_releases_the_noised_mean_of_no_update_when_every_reply_is_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DP-FedAvg's fixed denominator: a round whose 3 replies are all rejected moves the global
    tensors by the noise alone (std sigma C / 3) and counts the release, so an unchanged model
    never tells that every reply failed."""
    stds: list[float] = []

    def known(shapes: dict, std: float) -> dict[str, torch.Tensor]:
        stds.append(std)
        return {n: torch.full(shapes[n], 0.01, dtype=torch.float64) for n in sorted(shapes)}

    monkeypatch.setattr(noise, "fresh_gaussian", known)
    config = ExperimentConfig(method="fedavg", num_clients=3, dp="central", dp_clipping_norm=0.5)
    strategy, grid = tiny_strategy(config)
    before = {n: t.clone() for n, t in strategy.global_tensors.items()}
    metrics = _rejected_round(strategy, grid, 1)
    assert stds == [pytest.approx(accountant.noise_multiplier(config) * 0.5 / 3)]
    for name, tensor in strategy.global_tensors.items():
        torch.testing.assert_close(tensor, before[name] + 0.01)
    assert strategy.releases is not None and strategy.releases.rounds == [1]
    assert metrics == accountant.release_metrics(config, 1, stds[0])


def test_local_dp_reports_a_rounds_releases_when_every_reply_is_rejected() -> None:
    """The clients released in round 2 although the server rejected every reply: its metrics
    (and so the run's summary, read from the last round that has them) count 2 releases."""
    config = ExperimentConfig(method="fedavg", num_clients=3, dp="local", dp_clipping_norm=0.5)
    strategy, grid = tiny_strategy(config)
    play(strategy, grid, [1])
    kept = {n: t.clone() for n, t in strategy.global_tensors.items()}
    metrics = _rejected_round(strategy, grid, 2)
    assert metrics["dp-releases"] == 2.0
    assert metrics["dp-epsilon"] == accountant.epsilon_of(config, 2)
    assert all(torch.equal(t, kept[n]) for n, t in strategy.global_tensors.items())


def test_the_servers_clipped_deltas_keep_the_bound_that_a_float32_round_trip_loses() -> None:
    """10^6 float32 coordinates clipped to C = 0.04: received + clipped delta, cast back to
    float32, can lie beyond C (the review measured 0.04000002876); the float64 deltas the
    server sums stay within C up to float64 rounding."""
    g = torch.Generator().manual_seed(5)
    received = {"w": torch.randn(1_000_000, generator=g) * 3.0}
    sent = {"w": received["w"] + torch.randn(1_000_000, generator=g)}
    deltas = mechanism.clipped_deltas(sent, received, 0.04)
    assert deltas["w"].dtype == torch.float64
    norm = float(deltas["w"].pow(2).sum().sqrt())
    assert norm <= 0.04 * (1 + 1e-12)
    round_trip = mechanism.clip_update(sent, received, 0.04)
    assert torch.equal(round_trip["w"], (received["w"].double() + deltas["w"]).float())
