"""FedDPA: the dual adapter's mixture, eq. 2's aggregation, the dynamic weighting, and both
methods end to end on the tiny LLaMA (the local adapter never travels, survives a restart;
FedDPA-F's post-training round runs once, after the last round, and is checkpointed)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_language_task import LANGUAGE as BASE_LANGUAGE
from torch import nn
from traffic import assert_locally_noised, local_dp, run_recording

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.methods.settings import ConfigError
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import record_names

# The tiny-LLaMA run config of the language task's tests, with fewer generated tokens.
LANGUAGE = {**BASE_LANGUAGE, "max-new-tokens": 4}


def _config(run_config: dict) -> ExperimentConfig:
    return ExperimentConfig.from_run_config({**ExperimentConfig().to_run_config(), **run_config})


@pytest.fixture
def feddpa_config(small_run_config: dict, tmp_path: Path) -> dict:
    """Two clients (two instruction tasks), two rounds of two local steps, state on disk."""
    return {
        **small_run_config,
        **LANGUAGE,
        "method": "feddpa-t",
        "num-clients": 2,
        "local-steps": 2,
        "client-state-dir": str(tmp_path / "state"),
    }


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(6, 5)


def _dual_layer(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """One linear layer with both adapters, lora_B set to random values (not the zero init)."""
    from fedfm_flower.models.tuners.dual_lora import dual_lora_tuner, lora_layers

    torch.manual_seed(seed)
    config = ExperimentConfig(lora_rank=2, lora_alpha=6.0, lora_target_modules="q_proj")
    model = dual_lora_tuner(_Block(), config).backbone
    (layer,) = lora_layers(model)
    with torch.no_grad():
        for adapter in ("global", "local"):
            layer.lora_B[adapter].weight.normal_()
    return model, layer


def test_feddpa_t_mixture_is_the_papers_equation_on_one_linear_layer() -> None:
    from fedfm_flower.models.tuners.dual_lora import adapter_mix

    model, layer = _dual_layer()
    h = torch.randn(3, 4, 6)
    base = layer.base_layer
    scale = 6.0 / 2  # lora_alpha / r

    def delta(adapter: str) -> torch.Tensor:
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        return scale * h @ a.T @ b.T

    alpha = 0.3
    expected = base(h) + (1 - alpha) * delta("global") + alpha * delta("local")
    with adapter_mix(model, {"global": 1 - alpha, "local": alpha}):
        torch.testing.assert_close(model.q_proj(h), expected)
    # Outside a mixture the model is the global adapter alone, and the scales are restored.
    torch.testing.assert_close(model.q_proj(h), base(h) + delta("global"))
    # One weight per row: row i mixes with its own alpha_i.
    alphas = torch.tensor([0.0, 0.5, 1.0])
    with adapter_mix(model, {"global": 1 - alphas, "local": alphas}):
        out = model.q_proj(h)
    for i, a in enumerate(alphas.tolist()):
        row = base(h[i]) + (1 - a) * delta("global")[i] + a * delta("local")[i]
        torch.testing.assert_close(out[i], row)
    with pytest.raises(KeyError, match="unknown adapter"):
        with adapter_mix(model, {"other": 1.0}):
            pass


def test_eq2_averages_the_global_adapter_with_equal_client_weights() -> None:
    from fedfm_flower.models import TrainableTensors
    from strategies.feddpa import FedDPAStrategy
    from strategies.parts.replies import ClientReply

    names = {
        "m.q.lora_A.global.weight": "adapter.global",
        "m.q.lora_B.global.weight": "adapter.global",
        "m.q.lora_A.local.weight": "adapter.local",
    }
    initial = TrainableTensors({n: torch.zeros(2, 3) for n in names}, names)
    strategy = FedDPAStrategy(ExperimentConfig(method="feddpa-t"), initial)  # its split
    assert set(strategy.global_tensors) == {n for n, g in names.items() if g == "adapter.global"}
    rng = np.random.default_rng(0)
    values = [
        {
            n: torch.tensor(rng.normal(size=(2, 3)), dtype=torch.float32)
            for n in strategy.global_tensors
        }
        for _ in range(3)
    ]
    replies = [
        ClientReply(c, c, v, n, {})
        for c, (v, n) in enumerate(zip(values, (10, 300, 1), strict=True))
    ]
    strategy.aggregate(1, replies)
    for name, tensor in strategy.global_tensors.items():
        expected = np.mean([v[name].numpy() for v in values], axis=0)  # 1/M, not by data size
        np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-6)


# ------------------------------------------------------------------ dynamic weighting


@pytest.fixture(scope="module")
def weighted_model(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A tiny LLaMA with both adapters (random lora_B) and one client's data."""
    import os

    from fedfm_flower.models import build_model
    from fedfm_flower.tasks.instructions import InstructionFollowing

    cache = os.environ.get("FEDFM_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("cache"))
    config = _config({**LANGUAGE, "cache-dir": cache, "num-clients": 2, "method": "feddpa-t"})
    model = build_model(config, "dual-lora")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.5)
    data = InstructionFollowing().client_data(config, 0, 2)
    return model.eval(), data


def _hidden(model, input_ids, attention_mask) -> np.ndarray:  # noqa: ANN001
    """Final-layer hidden states with the global adapter alone, positions from the mask."""
    from fedfm_flower.models.tuners.dual_lora import GLOBAL_ONLY, adapter_mix

    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad(), adapter_mix(model, GLOBAL_ONLY):
        out = model.lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            output_hidden_states=True,
        )
    return out.hidden_states[-1].double().numpy()


def _independent_score(a: np.ndarray, b: np.ndarray, kind: str) -> float:
    from scipy.stats import pearsonr

    if kind == "cosine":
        return max(0.0, float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    if kind == "pearson":
        return max(0.0, float(pearsonr(a, b).statistic))
    return 1.0 - np.linalg.norm(a - b) / (np.linalg.norm(a) + np.linalg.norm(b))


@pytest.mark.parametrize("kind", ["cosine", "neg-l2", "pearson"])
@pytest.mark.parametrize("rep", ["last", "avg"])
def test_dynamic_weight_is_lambda_times_the_mean_similarity(weighted_model, kind, rep) -> None:
    from fedfm_flower.models.dynamic_mix import InstanceWeightedLM, prompt_mask

    model, data = weighted_model
    weighted = InstanceWeightedLM(
        model, data.train, instances=3, similarity=kind, representation=rep, scale=0.5, seed=7
    )
    input_ids, attention_mask, labels = (t[:4] for t in data.test.encoded.tensors)
    length = int(attention_mask.sum(1).max())
    input_ids, attention_mask, labels = (t[:, :length] for t in (input_ids, attention_mask, labels))
    alpha = weighted.weights(input_ids, attention_mask, labels)

    def vector(ids, mask, row_labels) -> np.ndarray:  # noqa: ANN001
        keep = prompt_mask(mask, row_labels)[0].numpy()
        hidden = _hidden(model, ids, mask)[0]
        return hidden[keep].mean(0) if rep == "avg" else hidden[np.flatnonzero(keep)[-1]]

    for row in range(4):
        sample = weighted.sample(input_ids[row][prompt_mask(attention_mask, labels)[row]])
        assert len(set(sample)) == 3
        query = vector(
            input_ids[row : row + 1], attention_mask[row : row + 1], labels[row : row + 1]
        )
        scores = []
        for index in sample:
            ids, mask, lab = (t[index : index + 1] for t in data.train.tensors)
            scores.append(_independent_score(query, vector(ids, mask, lab), kind))
        assert 0.0 <= min(scores) and max(scores) <= 1.0 + 1e-9
        assert alpha[row].item() == pytest.approx(0.5 * np.mean(scores), abs=2e-5)


def test_an_instance_weighs_the_same_in_the_loss_pass_and_in_generation(weighted_model) -> None:
    from fedfm_flower.models.dynamic_mix import InstanceWeightedLM
    from fedfm_flower.models.language.encoding import encode_prompts

    model, data = weighted_model
    weighted = InstanceWeightedLM(
        model,
        data.train,
        instances=5,
        similarity="cosine",
        representation="last",
        scale=1.0,
        seed=3,
    )
    input_ids, attention_mask, labels = (t[:3] for t in data.test.encoded.tensors)
    from_rows = weighted.weights(input_ids, attention_mask, labels)
    tokenizer = model.tokenizer
    tokenizer.padding_side = "left"
    prompts = tokenizer(
        encode_prompts(None, data.test.examples[:3]), return_tensors="pt", padding=True
    )
    from_prompts = weighted.weights(prompts["input_ids"], prompts["attention_mask"], None)
    torch.testing.assert_close(from_rows, from_prompts, atol=2e-5, rtol=0)


def test_alpha_t_weights_the_local_adapter_as_the_paper_says(weighted_model) -> None:
    from fedfm_flower.models.dynamic_mix import InstanceWeightedLM
    from fedfm_flower.models.tuners.dual_lora import adapter_mix

    model, data = weighted_model
    input_ids, attention_mask, labels = (t[:2] for t in data.test.encoded.tensors)
    outputs = {}
    for direction in ("local", "global"):
        weighted = InstanceWeightedLM(
            model,
            data.train,
            instances=5,
            similarity="cosine",
            representation="last",
            scale=0.3,
            seed=3,
            direction=direction,
        )
        with torch.no_grad():
            outputs[direction] = weighted(input_ids, attention_mask).logits
        alpha = torch.tensor(weighted.alphas)
    assert (alpha > 0).all() and (alpha <= 0.3).all()
    with torch.no_grad(), adapter_mix(model, {"global": 1 - alpha, "local": alpha}):
        paper = model(input_ids, attention_mask).logits
    with torch.no_grad(), adapter_mix(model, {"global": alpha, "local": 1 - alpha}):
        reversed_ = model(input_ids, attention_mask).logits
    torch.testing.assert_close(outputs["local"], paper)
    torch.testing.assert_close(outputs["global"], reversed_)
    assert not torch.allclose(paper, reversed_)


# ------------------------------------------------------------------ end to end


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_feddpa_t_local_adapter_never_travels_and_survives_a_restart(feddpa_config: dict) -> None:
    from safetensors.torch import load_file

    from server_apps.inprocess import ServerCrash, crash_in_round, run_in_process

    base = {**feddpa_config, "num-server-rounds": 2, "test-time-evaluation": True}
    replies = []

    def keep(client_id, reply):  # noqa: ANN001, ANN202
        replies.append(reply)
        return reply

    full, grid = run_in_process({**base, "run-name": "whole"}, 2, keep)
    travelled = [grid.sent, [r for r in replies]]
    for messages in travelled:
        for message in messages:
            arrays = message.content.array_records.get(P.ARRAYS)
            names = set(record_names(arrays)) if arrays is not None else set()
            assert not any(".local." in n for n in names)
            if message.metadata.message_type == "train":
                assert names and all(".lora_" in n and ".global." in n for n in names)
    state = Path(base["client-state-dir"]) / "whole"
    saved = [load_file(sorted(d.glob("round_*.safetensors"))[-1]) for d in sorted(state.iterdir())]
    assert len(saved) == 2 and all(set(s) and all(".local." in n for n in s) for s in saved)
    name = next(n for n in saved[0] if ".lora_B." in n)
    assert not torch.equal(saved[0][name], saved[1][name])  # each client's own local adapter
    record = _records(Path(base["output-dir"]) / "whole")[-1]
    for metrics in record["evaluate"].values():
        assert 0.0 < metrics[P.test_metric("alpha")] <= 0.5  # lambda = alpha for FedDPA-T
        assert 0.0 <= metrics[P.test_metric("ttp-rouge-1")] <= 1.0
    with pytest.raises(ServerCrash):
        run_in_process({**base, "run-name": "crashed"}, 2, crash_in_round(2))
    resumed, _ = run_in_process({**base, "run-name": "crashed", "resume": True}, 2)
    assert resumed["final-per-client-rouge-1"] == full["final-per-client-rouge-1"]


def test_feddpa_f_fine_tunes_the_local_adapter_once_after_the_last_round(
    feddpa_config: dict,
) -> None:
    from safetensors.torch import load_file

    from server_apps.inprocess import run_in_process

    base = {**feddpa_config, "method": "feddpa-f", "run-name": "f", "fraction-train": 0.5}
    summary, grid = run_in_process(base, 2)
    run_dir = Path(base["output-dir"]) / "f"
    records = _records(run_dir)
    assert [(r["round"], r["phase"]) for r in records] == [
        (1, "train"),
        (2, "train"),
        (3, "post-training"),
    ]
    assert [r["clients-sampled"] for r in records] == [1, 1, 2]  # every client fine-tunes
    assert records[2]["bytes-up-train"] == 0  # the local adapters stay home
    assert (run_dir / "checkpoints" / "round_00003.safetensors").is_file()
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["client-tasks"] == {"0": "paraphrase", "1": "entailment"}  # Table 1's columns
    # the card names tiny-llama's build: its weights' digest and every file of it in the cache
    card, cache = saved["foundation"], Path(saved["run-config"]["cache-dir"])
    weights, *others = (cache / name for name in card["cache-files"])
    assert card["weights-sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert weights.suffix == ".safetensors" and weights.with_suffix(".json") in others
    assert any(weights.with_suffix(".tokenizer") in f.parents for f in others)
    state = Path(base["client-state-dir"]) / "f"
    for client in sorted(state.iterdir()):
        assert [p.name for p in sorted(client.glob("round_*.safetensors"))] == [
            "round_00003.safetensors"
        ]
        local = load_file(client / "round_00003.safetensors")
        assert local and all(".local." in n for n in local)
    # FL rounds evaluate the global adapter alone (no alpha); the final one mixes, lambda = 1.
    assert all(P.test_metric("alpha") not in m for m in records[1]["evaluate"].values())
    assert all(0.0 < m[P.test_metric("alpha")] <= 1.0 for m in records[2]["evaluate"].values())
    # The post-training round sends the final global adapter and leaves it unchanged.
    post = [m for m in grid.sent if m.metadata.group_id == "3"]
    assert post and all(m.content["config"]["phase"] == "post-training" for m in post)


@pytest.mark.parametrize(
    "variant",
    [{"feddpa-weighting": "fixed"}, {"feddpa-prox-mu": 0.1, "feddpa-similarity": "pearson"}],
)
def test_feddpa_variants_run_end_to_end(feddpa_config: dict, variant: dict) -> None:
    from server_apps.inprocess import run_in_process

    summary, _ = run_in_process({**feddpa_config, **variant, "num-server-rounds": 1}, 2)
    assert set(summary["final-per-client-rouge-1"]) == {"0", "1"}


@pytest.mark.parametrize("method", ["local", "fedavg-ft", "centralized"])
def test_table1_baselines_run_on_the_instruction_task(feddpa_config: dict, method: str) -> None:
    from server_apps.inprocess import run_in_process

    config = {**feddpa_config, "method": method, "num-server-rounds": 1, "run-name": "b"}
    if method == "centralized":  # one epoch: the center sees every pooled row once
        config.update({"local-steps": 0, "local-epochs": 1})
    summary, _ = run_in_process(config, 2)
    assert set(summary["final-per-client-rouge-1"]) == {"0", "1"}
    record = _records(Path(config["output-dir"]) / "b")[0]
    if method == "centralized":  # one client trains on both clients' training data
        (center,) = record["train"].values()
        pooled = sum(c["train"] for c in summary["client-examples"].values())
        assert center[P.NUM_EXAMPLES] == pooled
        assert set(record["evaluate"]) == {"0", "1"}


def test_proximal_term_is_fedprox() -> None:
    from fedfm_flower.tasks.training import proximal_term

    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    term = proximal_term({"w": w}, {"w": torch.tensor([0.0, 4.0])}, mu=0.2)
    assert term().item() == pytest.approx(0.5 * 0.2 * (1.0 + 4.0))


def test_feddpa_settings_and_modalities_fail_early() -> None:
    with pytest.raises(ConfigError, match="feddpa-scale"):
        _config({"feddpa-scale": "1.5"})
    with pytest.raises(ConfigError, match="feddpa-similarity"):
        _config({"feddpa-similarity": "dot"})
    with pytest.raises(ConfigError, match="method"):
        _config({"method": "feddpa-t"})  # the default backbone is a ViT
    config = _config({**LANGUAGE, "method": "feddpa-f", "feddpa-alpha": 0.3})
    from fedfm_flower.methods.feddpa import FedDPASettings

    settings = config.settings_of(FedDPASettings)
    assert settings.lambda_for(True) == 0.3 and settings.lambda_for(False) == 1.0


def test_sample_per_task_takes_the_fraction_of_every_tasks_clients() -> None:
    from fedfm_flower.models import TrainableTensors
    from strategies.feddpa import FedDPAStrategy
    from strategies.parts.context import RunContext

    names = {"m.q.lora_A.global.weight": "adapter.global"}
    initial = TrainableTensors({n: torch.zeros(2, 3) for n in names}, names)
    config = ExperimentConfig(fraction_train=0.4, sample_per_task=True, num_clients=40)
    context = RunContext(client_tasks={c: f"task-{c % 8}" for c in range(40)})
    strategy = FedDPAStrategy(config, initial, context)
    strategy.nodes.node_to_client = {100 + c: c for c in range(40)}  # as if identified
    seen = set()
    for server_round in range(1, 6):
        chosen = strategy.train_clients(server_round)
        per_task = [sum(1 for c in chosen if c % 8 == t) for t in range(8)]
        assert per_task == [2] * 8  # ceil(0.4 * 5) of each task's 5 clients
        assert chosen == strategy.train_clients(server_round)  # seeded
        seen |= set(chosen)
    assert len(seen) > 16  # different clients in different rounds
    uniform = FedDPAStrategy(config.replace(sample_per_task=False), initial, context)
    uniform.nodes.node_to_client = strategy.nodes.node_to_client
    assert len(uniform.train_clients(1)) == 16


# ---------------------------------------------------------------- privacy
# The privacy tests check what travels: one client evaluates, with the fixed mixture.
CHEAP_EVALUATION = {"fraction-evaluate": 0.5, "feddpa-weighting": "fixed"}


def test_feddpa_f_under_central_dp_noises_the_equal_weight_mean_and_its_post_round_releases_nothing(
    feddpa_config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FedDPA-F, 2 clients, 1 federated round under central DP: each reply's global-adapter
    update is within C as it leaves the client; the next payload is the round's plus the
    clipped updates' sum over the 2 sampled clients (eq. 2's equal weights) plus exactly the
    round's drawn noise; the post-training round sends nothing up, draws no noise, counts no
    release and leaves the global adapter as round 1 did; no local adapter travels."""
    from safetensors.torch import load_file
    from test_privacy import NoiseSpy, delta_norm

    from fedfm_flower.privacy import mechanism

    clip, sigma = 0.05, 0.7
    spy = NoiseSpy(monkeypatch)
    config = {
        **feddpa_config,
        **CHEAP_EVALUATION,
        "method": "feddpa-f",
        "run-name": "central",
        "num-server-rounds": 1,
        "fraction-train": 1.0,
        "dp": "central",
        "dp-clipping-norm": clip,
        "dp-noise-multiplier": sigma,
        "dp-delta": 1e-4,
    }
    summary, traffic = run_recording(config, 2)
    assert sorted(traffic) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for (server_round, _), (received, sent) in traffic.items():
        assert all(".global." in n for n in received)
        if server_round == 2:  # the post-training round: the local fine-tuning stays home
            assert sent == {}
            continue
        assert set(sent) == set(received)
        assert delta_norm(sent, received) <= clip * (1 + 1e-5)
    (drawn,) = spy.draws  # round 1's release; none in the post-training round
    start, after = traffic[(1, 0)][0], traffic[(2, 0)][0]
    for name, tensor in start.items():
        total = sum(
            mechanism.clip_update(traffic[(1, c)][1], start, clip)[name].double() - tensor.double()
            for c in (0, 1)
        )
        expected = tensor.double() + total / 2 + drawn[name]
        torch.testing.assert_close(after[name].double(), expected, rtol=0, atol=1e-6)
    checkpoints = Path(config["output-dir"]) / "central" / "checkpoints"
    after_1, after_2 = (load_file(checkpoints / f"round_0000{r}.safetensors") for r in (1, 2))
    assert after_1.keys() == after_2.keys()
    assert all(torch.equal(after_1[n], after_2[n]) for n in after_1)
    assert summary["dp-releases"] == 1
    ledger = json.loads((checkpoints.parent / "privacy.json").read_text())
    assert ledger["releases"] == [1]


def test_feddpa_t_under_local_dp_sends_noised_clipped_global_updates_only(
    feddpa_config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FedDPA-T under local DP: each reply is the client's received global adapter plus its
    clipped update plus the noise it drew (std sigma C per value), the local adapter trains and
    stays home, and each federated round counts one release."""
    from test_privacy import NoiseSpy

    clip, sigma = 0.05, 2.0
    spy = NoiseSpy(monkeypatch)
    config = {
        **feddpa_config,
        **CHEAP_EVALUATION,
        **local_dp(clip, sigma),
        "run-name": "local-dp",
        "num-server-rounds": 1,
    }
    summary, traffic = run_recording(config, 2)
    assert sorted(traffic) == [(1, 0), (1, 1)]
    assert len(spy.draws) == 2  # one release per client
    for received, sent in traffic.values():
        assert all(".global." in n for n in sent)
        assert_locally_noised(sent, received, spy.draws, clip, sigma)
    state = Path(config["client-state-dir"]) / "local-dp"
    assert len(list(state.glob("client_*/round_00001.safetensors"))) == 2  # local adapters kept
    assert summary["dp-releases"] == 1


def test_feddpa_t_under_secagg_equals_the_plain_run_within_quantization(
    feddpa_config: dict,
) -> None:
    """FedDPA-T, 2 clients, 1 round with and without SecAgg+: the global adapter after the round
    agrees within the quantization of two weight-1 updates, and the training replies left their
    clients without arrays."""
    from safetensors.torch import load_file

    from server_apps.inprocess import run_in_process

    globals_ = {}
    for secagg in (False, True):
        name = f"secagg-{secagg}"
        up: list = []
        config = {
            **feddpa_config,
            **CHEAP_EVALUATION,
            "run-name": name,
            "num-server-rounds": 1,
            "secagg": secagg,
            "secagg-clipping-range": 1.0,
        }
        run_in_process(config, 2, lambda c, r, up=up: up.append(r) or r)
        checkpoint = Path(config["output-dir"]) / name / "checkpoints" / "round_00001.safetensors"
        globals_[secagg] = load_file(checkpoint)
        if secagg:
            trained = [r for r in up if P.METRICS in r.content.metric_records]
            assert trained and all(
                all(len(a) == 0 for a in r.content.array_records.values()) for r in trained
            )
    step = 2 * 1.0 / 2**22  # a weight-1 value's quantization step in [-1, 1]
    assert globals_[False].keys() == globals_[True].keys()
    for name, plain in globals_[False].items():
        error = (globals_[True][name].double() - plain.double()).abs().max().item()
        assert error <= 2 * step + 1e-6, (name, error)
