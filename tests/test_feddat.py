"""FedDAT: the LoRA layer's second branch (absent: the plain layer, bit for bit; present: the hand
sum of the two updates), the Dual-Adapter Teacher built from a model, mutual KD against the
official formulation on a tiny case, and the method end to end on the multi-task federation
(the client-specific adapter never travels and survives a restart)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedfm_flower.models.groups import GroupPattern, TunedModel
from fedfm_flower.models.multimodal import LoRALinear
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import numpy_arrays


def _layer(seed: int = 0, dropout: float = 0.0) -> LoRALinear:
    torch.manual_seed(seed)
    layer = LoRALinear(nn.Linear(5, 3), rank=2, alpha=4.0, dropout=dropout)
    with torch.no_grad():
        layer.lora_b.normal_()  # a non-zero update
    return layer


def test_lora_linear_without_a_branch_is_the_plain_layer_bit_for_bit() -> None:
    layer = _layer(dropout=0.2)
    assert layer.branch is None
    assert set(layer.state_dict()) == {"base.weight", "base.bias", "lora_a", "lora_b"}
    x = torch.randn(4, 7, 5)
    layer.train()
    torch.manual_seed(3)
    got = layer(x)
    torch.manual_seed(3)  # the same dropout mask: the forward before branches existed
    dropped = F.dropout(x, 0.2, training=True)
    expected = layer.base(x) + layer.scale * F.linear(F.linear(dropped, layer.lora_a), layer.lora_b)
    assert torch.equal(got, expected)
    layer.eval()
    plain = layer.base(x) + layer.scale * F.linear(F.linear(x, layer.lora_a), layer.lora_b)
    assert torch.equal(layer(x), plain)


@pytest.mark.parametrize(("weight", "main_weight"), [(0.5, 0.5), (1.0, 1.0), (0.3, 0.7)])
def test_dat_forward_is_the_hand_sum_of_the_two_lora_updates(
    weight: float, main_weight: float
) -> None:
    layer = _layer()
    branch = layer.add_branch(weight, main_weight)
    assert torch.equal(branch.lora_a, layer.lora_a)  # A_c starts as a copy of the layer's own
    with torch.no_grad():
        branch.lora_a.normal_()
        branch.lora_b.normal_()
    x = torch.randn(6, 5)
    w, b = layer.base.weight.detach().double().numpy(), layer.base.bias.detach().double().numpy()
    a_g, b_g = layer.lora_a.detach().double().numpy(), layer.lora_b.detach().double().numpy()
    a_c, b_c = branch.lora_a.detach().double().numpy(), branch.lora_b.detach().double().numpy()
    xs = x.double().numpy()
    delta_g = xs @ a_g.T @ b_g.T * (4.0 / 2)
    delta_c = xs @ a_c.T @ b_c.T * (4.0 / 2)
    expected = xs @ w.T + b + main_weight * delta_g + weight * delta_c
    np.testing.assert_allclose(layer(x).detach().double().numpy(), expected, rtol=1e-5, atol=1e-5)
    assert {"branch.lora_a", "branch.lora_b"} <= set(layer.state_dict())


def test_vilts_embedding_and_convolution_lora_take_a_dat_branch_too() -> None:
    """mm-vilt's encoders tune a LoRA embedding and a LoRA convolution: with a branch each is
    its base plus scale * (w_main U(B, A) + w U(B', A')), computed here by hand."""
    from fedfm_flower.models.multimodal_hf import LoRAConv2d, LoRAEmbedding

    torch.manual_seed(0)
    embedding = LoRAEmbedding(nn.Embedding(7, 4), rank=2, alpha=4.0)
    conv = LoRAConv2d(nn.Conv2d(3, 5, kernel_size=2, stride=2), rank=2, alpha=4.0)
    ids, image = torch.tensor([[0, 3, 6], [2, 2, 5]]), torch.randn(2, 3, 4, 4)
    for layer in (embedding, conv):
        branch = layer.add_branch(0.3, 0.7)
        with torch.no_grad():
            for p in (layer.lora_b, branch.lora_a, branch.lora_b):
                p.normal_()
    e_base = embedding.base.weight.detach().double()

    def token_update(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.detach().double().T[ids]) @ b.detach().double().T

    expected = e_base[ids] + 2.0 * (
        0.7 * token_update(embedding.lora_a, embedding.lora_b)
        + 0.3 * token_update(embedding.branch.lora_a, embedding.branch.lora_b)
    )
    torch.testing.assert_close(embedding(ids).double(), expected, rtol=1e-5, atol=1e-5)

    def patch_update(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # each 2x2 patch (stride 2) flattened, times A flattened, then B: no convolution call
        patches = image.double().unfold(2, 2, 2).unfold(3, 2, 2)  # (n, c, 2, 2, kh, kw)
        flat = patches.permute(0, 2, 3, 1, 4, 5).reshape(2, 2, 2, -1)
        low = flat @ a.detach().double().reshape(2, -1).T
        return (low @ b.detach().double().T).permute(0, 3, 1, 2)

    base = conv.base(image).double()
    expected = base + 2.0 * (
        0.7 * patch_update(conv.lora_a, conv.lora_b)
        + 0.3 * patch_update(conv.branch.lora_a, conv.branch.lora_b)
    )
    torch.testing.assert_close(conv(image).double(), expected, rtol=1e-5, atol=1e-5)


class _Tiny(TunedModel):
    """One LoRA layer and a head: the shape of the multi-modal model's parts."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = _layer()
        self.head = nn.Linear(3, 2)
        self.group_patterns = (
            GroupPattern("adapter", r"^layer\.(.*\.)?lora_[ab]$"),
            GroupPattern("decoder", r"^head\."),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


def test_the_dat_copies_the_global_components_and_shares_the_backbone() -> None:
    from client_apps.feddat import branch_name, dual_adapter_teacher, lora_names

    model = _Tiny()
    names = list(model.parameter_groups())
    assert lora_names(names) == ["layer.lora_a", "layer.lora_b"]
    client = {n: torch.randn_like(model.tensors_named([n])[n]) for n in lora_names(names)}
    dat = dual_adapter_teacher(model, names, client, local_weight=0.25)
    assert model.layer.branch is None  # the model itself is untouched
    assert dat.layer.base.weight is model.layer.base.weight  # the frozen backbone is shared
    for n in names:  # A_g (and the decoder) are frozen copies of the model's
        assert dat.get_parameter(n) is not model.get_parameter(n)
        assert torch.equal(dat.get_parameter(n), model.get_parameter(n))
        assert not dat.get_parameter(n).requires_grad
    for n, value in client.items():
        assert torch.equal(dat.get_parameter(branch_name(n)), value)
    assert (dat.layer.branch.weight, dat.layer.branch.main_weight) == (0.25, 0.75)
    x = torch.randn(3, 5)
    layer = model.layer
    own = F.linear(F.linear(x, layer.lora_a), layer.lora_b)
    other = F.linear(F.linear(x, client["layer.lora_a"]), client["layer.lora_b"])
    hidden = layer.base(x) + layer.scale * (0.75 * own + 0.25 * other)
    assert torch.allclose(dat(x), model.head(hidden), atol=1e-6)
    with pytest.raises(ValueError, match="not a LoRA factor"):
        branch_name("head.weight")
    plain = _Tiny()
    plain.layer = nn.Module()  # LoRA factors on a layer without a second branch
    plain.layer.lora_a, plain.layer.lora_b = (
        nn.Parameter(torch.ones(2, 5)),
        nn.Parameter(torch.ones(3, 2)),
    )
    with pytest.raises(TypeError, match="'layer.lora_a' belongs to a Module"):
        dual_adapter_teacher(plain, ["layer.lora_a", "layer.lora_b"], client, 0.5)


def _official_kl(output: torch.Tensor, target: torch.Tensor, temp: float) -> torch.Tensor:
    """``kl_loss`` of the authors' task_trainer.py (classes on the last dimension)."""
    p = F.log_softmax(output / temp, dim=-1)
    q = F.softmax(target / temp, dim=-1)
    return F.kl_div(p, q, reduction="batchmean") * temp**2


def test_mutual_kd_matches_the_official_two_losses_by_hand() -> None:
    from client_apps.feddat import mutual_distillation
    from fedfm_flower.tasks.multitask import TaskOutput

    torch.manual_seed(0)
    temp, batch = 3.0, 5
    labels = torch.tensor([0, 2, 1])
    s_logits = torch.randn(3, 4, requires_grad=True)  # the shared adapter's class logits
    d_logits = torch.randn(3, 4, requires_grad=True)  # the DAT's
    s_images = torch.rand(2, 3, 4, 4, requires_grad=True)
    d_images = torch.rand(2, 3, 4, 4, requires_grad=True)
    targets = torch.rand(2, 3, 4, 4)
    rows_c, rows_g = torch.tensor([0, 2, 4]), torch.tensor([1, 3])

    def outputs(logits: torch.Tensor, images: torch.Tensor) -> dict[str, TaskOutput]:
        return {
            "image-cls": TaskOutput(
                "image-cls", rows_c, logits, labels, F.cross_entropy(logits, labels)
            ),
            "image-gen": TaskOutput(
                "image-gen", rows_g, images, targets, F.mse_loss(images, targets)
            ),
        }

    loss_s, loss_c, sums = mutual_distillation(
        outputs(s_logits, s_images), outputs(d_logits, d_images), batch, temp
    )
    # By hand (numpy): L = sum_o n_o / B * (loss_o + c_o KD_o) / 2, c = T^2 for KL, 1 for MSE.
    s, d, y = s_logits.detach().double().numpy(), d_logits.detach().double().numpy(), labels.numpy()

    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    def kl(teacher: np.ndarray, student: np.ndarray) -> float:
        lt, ls = log_softmax(teacher / temp), log_softmax(student / temp)
        return float(np.mean(np.sum(np.exp(lt) * (lt - ls), -1)))

    def ce(z: np.ndarray) -> float:
        return float(-np.mean(log_softmax(z)[np.arange(3), y]))

    si, di = s_images.detach().double().numpy(), d_images.detach().double().numpy()
    tg, mse = targets.double().numpy(), lambda a, b: float(np.mean((a - b) ** 2))
    hand_s = 3 / 5 * (ce(s) + temp**2 * kl(d, s)) / 2 + 2 / 5 * (mse(si, tg) + mse(si, di)) / 2
    hand_c = 3 / 5 * (ce(d) + temp**2 * kl(s, d)) / 2 + 2 / 5 * (mse(di, tg) + mse(di, si)) / 2
    assert loss_s.item() == pytest.approx(hand_s, rel=1e-5)
    assert loss_c.item() == pytest.approx(hand_c, rel=1e-5)
    assert sums["count-image-cls"] == 3.0 and sums["loss-image-cls"] == pytest.approx(3 * ce(s))
    # The summed loss gives each side the gradient of its own official loss (L_1 for the shared
    # adapter against the detached DAT, L_0 for the DAT against the detached shared outputs).
    (loss_s + loss_c).backward()
    grads = [t.grad.clone() for t in (s_logits, d_logits)]
    for t in (s_logits, d_logits):
        t.grad = None
    official_1 = (
        F.cross_entropy(s_logits, labels) + _official_kl(s_logits, d_logits.detach(), temp)
    ) / 2
    official_0 = (
        F.cross_entropy(d_logits, labels) + _official_kl(d_logits, s_logits.detach(), temp)
    ) / 2
    (3 / 5 * (official_1 + official_0)).backward()
    assert torch.allclose(grads[0], s_logits.grad, atol=1e-6)
    assert torch.allclose(grads[1], d_logits.grad, atol=1e-6)


@pytest.fixture
def feddat_config(multitask_run_config: dict) -> dict:
    """FedDAT on the small multi-task federation."""
    return {**multitask_run_config, "method": "feddat"}


def test_feddat_end_to_end_the_client_adapter_stays_home_and_survives_a_restart(
    feddat_config: dict,
) -> None:
    from safetensors.torch import load_file

    from client_apps.feddat import CLIENT, GLOBAL, lora_names
    from fedfm_flower.learners.aggregation import average_over_owners
    from fedfm_flower.records.messages import from_array_record
    from server_apps.inprocess import ServerCrash, crash_in_round, run_in_process

    sent: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (round, client) -> A_s sent

    def keep(client_id, reply):  # noqa: ANN001, ANN202
        arrays = reply.content.array_records.get(P.ARRAYS)
        if reply.metadata.message_type == "train" and arrays is not None:
            sent[(int(reply.metadata.group_id), client_id)] = from_array_record(arrays)
        return reply

    full, _ = run_in_process({**feddat_config, "run-name": "whole"}, 4, keep)
    run_dir = Path(feddat_config["output-dir"]) / "whole"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["phase"]) for r in records] == [(1, "train"), (2, "train")]
    assert set(sent) == {(r, c) for r in (1, 2) for c in range(4)}
    train_metrics = records[0]["train"]["0"]
    assert any(k.startswith("train-mkd-shared-") for k in train_metrics), train_metrics
    state = Path(feddat_config["client-state-dir"]) / "whole"
    # Round 2's A_g is the server's unweighted average of round 1's replies, over the owners.
    averaged = average_over_owners([sent[(1, c)] for c in range(4)], [1.0] * 4)
    for client in range(4):
        w = sent[(2, client)]
        assert w and not any("branch" in n for n in w)  # only A_s travels
        kept = load_file(state / f"client_{client}" / "round_00002.safetensors")
        a_c = {k[len(CLIENT) :]: v for k, v in kept.items() if k.startswith(CLIENT)}
        a_g = {k[len(GLOBAL) :]: v for k, v in kept.items() if k.startswith(GLOBAL)}
        assert set(kept) == {CLIENT + n for n in a_c} | {GLOBAL + n for n in a_g}
        assert set(a_g) == set(w) and set(a_c) == set(lora_names(w)) and a_c
        for n, value in a_g.items():
            assert torch.allclose(value, averaged[n], atol=1e-6), n
        assert any(not torch.equal(a_c[n], w[n]) for n in a_c)  # A_c is not what was sent
    # A restart (fresh contexts) reloads A_c and A_g from disk: the same final metrics.
    with pytest.raises(ServerCrash):
        run_in_process({**feddat_config, "run-name": "crashed"}, 4, crash_in_round(2))
    resumed, _ = run_in_process({**feddat_config, "run-name": "crashed", "resume": True}, 4)
    assert resumed["final-per-client-task-score"] == full["final-per-client-task-score"]


def test_feddat_post_train_runs_mkd_on_a_copy_before_evaluating_and_keeps_nothing(
    feddat_config: dict, monkeypatch
) -> None:
    """FedDAT + Post-train: training, what travels and the client state are FedDAT's, bit for
    bit; each evaluation first runs ``finetune-steps`` iterations of mutual KD, then evaluates."""
    from client_apps.base import ClientRuntime
    from client_apps.feddat import MutualDistillationTask
    from server_apps.inprocess import run_in_process

    calls: list[tuple[str, int | None]] = []
    original = ClientRuntime.train

    def recording(self, model, names, seed, **kwargs):  # noqa: ANN001, ANN202
        kind = type(kwargs.get("task")).__name__
        calls.append((kind, kwargs.get("steps")))
        return original(self, model, names, seed, **kwargs)

    monkeypatch.setattr(ClientRuntime, "train", recording)
    sent: dict[str, dict] = {"feddat": {}, "feddat-ft": {}}

    def keeper(method):  # noqa: ANN001, ANN202
        def keep(client_id, reply):  # noqa: ANN001, ANN202
            arrays = reply.content.array_records.get(P.ARRAYS)
            if reply.metadata.message_type == "train" and arrays is not None:
                sent[method][client_id] = numpy_arrays(arrays)
            return reply

        return keep

    config = {**feddat_config, "num-server-rounds": 1, "finetune-steps": 3}
    summaries = {}
    for method in ("feddat", "feddat-ft"):
        calls.clear()
        summaries[method], _ = run_in_process(
            {**config, "method": method, "run-name": method}, 4, keeper(method)
        )
        training = [c for c in calls if c == (MutualDistillationTask.__name__, None)]
        fine_tuning = [c for c in calls if c == (MutualDistillationTask.__name__, 3)]
        assert len(training) == 4  # one MKD schedule per client and round
        assert len(fine_tuning) == (4 if method == "feddat-ft" else 0), calls
    for client in range(4):
        a, b = sent["feddat"][client], sent["feddat-ft"][client]
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        state = Path(config["client-state-dir"])
        files = [f"client_{client}/round_00001.safetensors"]
        for name in files:
            assert (state / "feddat" / name).read_bytes() == (
                state / "feddat-ft" / name
            ).read_bytes()
    scores = {m: s["final-per-client-task-score"] for m, s in summaries.items()}
    assert scores["feddat"] != scores["feddat-ft"]  # the post-training changed the DAT
