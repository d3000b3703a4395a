"""FedDAT's client (Chen et al., AAAI 2024): a Dual-Adapter Teacher and Mutual Knowledge
Distillation, on TAP's multi-modal multi-task model (one of TAP's baselines, sec. 5.1).

**FedDAT.** Every client holds three adapters on a frozen foundation model: the *shared* adapter
A_s (the one it trains and sends; the server averages it), a frozen copy A_g of the global
adapter it received this round, and a *client-specific* adapter A_c that never leaves it. A_c and
A_g form the Dual-Adapter Teacher (DAT), whose output mixes the two adapters' outputs with equal
weights. Every mini-batch runs Mutual Knowledge Distillation (MKD):

1. the shared adapter learns from the task and from the DAT:
   L_s = (loss(A_s) + T^2 KL(p_DAT || p_s)) / 2, the DAT's outputs detached;
2. the DAT's A_c learns from the task and from the shared adapter:
   L_c = (loss(DAT) + T^2 KL(p_s || p_DAT)) / 2, the shared adapter's outputs detached,

with p = softmax(z / T), T = 3. The client sends A_s; it keeps A_c and A_g; it evaluates the DAT.

**Where it comes from** (github.com/HaokunChen245/FedDAT, ``src/``): the three adapters and what
is shared or personal: ``prepare_model`` in ``train/main.py`` (``adapter_0`` client-specific,
``adapter_1`` shared and the only thing sent, ``adapter_2`` the frozen global copy); A_g := the
received A_s at the start of local training: ``TaskTrainer.train`` in
``train/visionlanguage_tasks/task_trainer.py``; the MKD step and its losses:
``TaskTrainer.train_step`` and ``kl_loss`` (same file; ``batchmean`` KL times T^2, T = 3); the DAT's
forward, the mean of the two adapters' outputs (the learned gating is commented out):
``Adapter.forward`` in ``modeling/models/adapter.py``; the server's unweighted average
(``nums = [1, ...]``): ``main`` and ``get_average_net`` in ``train/main.py``; evaluation of the
DAT with the personal ``adapter_0`` and ``adapter_2`` restored over the averaged model:
``main`` (``personal_params``) and ``TaskTrainer.eval`` (``activate_gating``).

**Adaptations to our model** (``fedfm_flower.models.multimodal``):

* *Adapters are the model's LoRA.* The official adapters are bottleneck adapters after each
  layer's FFN; ours are the LoRA updates on the frozen experts' ``fc1``/``fc2``, the attention
  ``qkv`` and the encoders. A_s is the LoRA layer's own factors, A_c a second branch of the same
  shape (``LoRALayer.add_branch``), and the DAT's per-layer update is
  ``(alpha / r) ((1 - w) B_g A_g + w B_c A_c) x`` with ``w = feddat-local-weight`` (0.5: the
  official mean of the two adapters' outputs; LoRA being linear, the mean of the two updates).
* *Components.* A client trains and sends the components of its modality-task pairs
  (``names_for``), and the server averages each component over the clients that sent it
  (``strategies.feddat``), as FedAvg and TAP do here; A_c and A_g cover the same components.
* *Decoders.* The official task heads are personal (in every method of its benchmark) and trained
  in both MKD steps. Here the decoders and the text projection are components of the model,
  federated as in FedAvg and TAP: they belong to the shared adapter (trained in step 1, sent), and
  the DAT uses the frozen received copy of them; only A_c trains in step 2.
* *One DAT forward per batch.* The official computes the DAT's outputs twice, without gradients
  before step 1 and with them after it; step 1 changes none of the DAT's parameters here, so the
  two differ only in dropout masks, and one forward serves both. L_s and L_c touch disjoint
  parameters, so the loop steps their sum once: for a per-parameter optimizer that is the
  official's two optimizer steps. The optimizer, learning rate and local schedule are the run
  config's (the official: AdamW, lr 1e-4, linear warm-up and decay, one local epoch).
* *Multi-task KD.* The KD term of a pair is ``fedfm_flower.tasks.distillation.distillation_loss``:
KL over
  the classes, KL per scored target token (text generation and VQA), and, for generated images
  (no logits), the mean squared difference; T^2 scales the KL terms only. Pairs are weighted by
  their share of the batch, lambda_o = n_o / B, as the task loss (TAP's eq. 2);
  ``feddat-distill-weight`` multiplies the KD terms (1 in the official).
* *State.* A_c and A_g live in the client state (``client.<name>``, ``global.<name>``), so they
  survive restarts; A_c starts from the model's seeded LoRA initialisation (B = 0: a zero update;
  the official draws its adapter's weights from N(0, 0.02)).
* *Layers.* A_c is a branch of every LoRA layer the client trains: linear layers
  (``mm-offline``, ``mm-flava``, ViLT's backbone) and ViLT's LoRA embedding and convolution
  (``multimodal_hf``), each the same mixture of its two updates; any other layer is refused by
  name.
* *Evaluation* is the DAT: A_g of the client's latest training round with A_c, as the official
  evaluates. A client that has not trained yet evaluates the received global adapter alone.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from client_apps.base import ClientLogic, ClientRuntime
from fedfm_flower.data.multitask import IMAGE_GENERATION, PAIRS
from fedfm_flower.methods.feddat import FedDATSettings
from fedfm_flower.models import TunedModel
from fedfm_flower.models.multimodal import LoRALayer
from fedfm_flower.tasks.base import Batch, StepResult, Task, TrainingObjective
from fedfm_flower.tasks.distillation import distillation_loss
from fedfm_flower.tasks.multitask import task_outputs
from fedfm_flower.tasks.training import EvalStats, TrainStats

if TYPE_CHECKING:
    from fedfm_flower.tasks.multitask import TaskOutput

CLIENT = "client."  # client-state key prefix of A_c's factors (named like A_s's)
GLOBAL = "global."  # client-state key prefix of A_g, the frozen received components
FACTORS = ("lora_a", "lora_b")


def lora_names(names: Iterable[str]) -> list[str]:
    """The LoRA factors among parameter ``names`` (the adapter; decoders are not)."""
    return [n for n in names if n.rpartition(".")[2] in FACTORS]


def branch_name(name: str) -> str:
    """A_c's twin of a LoRA factor: ``<layer>.lora_a`` -> ``<layer>.branch.lora_a``."""
    layer, _, factor = name.rpartition(".")
    if factor not in FACTORS:
        raise ValueError(f"'{name}' is not a LoRA factor")
    return f"{layer}.branch.{factor}"


def dual_adapter_teacher(
    model: TunedModel, names: Iterable[str], client: Mapping[str, torch.Tensor], local_weight: float
) -> TunedModel:
    """The DAT: ``model`` with its parameters ``names`` (A_g) copied and frozen, every other
    parameter shared with it (not copied), and A_c (``client``, keyed by A_s's factor names) as
    a second branch of the LoRA layers it covers, mixed with weight ``local_weight``."""
    own = set(names)
    memo: dict[int, Any] = {id(p): p for n, p in model.named_parameters() if n not in own}
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        memo[id(tokenizer)] = tokenizer
    dat = copy.deepcopy(model, memo)
    copies = dict(dat.named_parameters())
    for name in own:
        copies[name].requires_grad_(False)

    modules = dict(dat.named_modules())
    for name in client:
        layer = modules[name.rpartition(".")[0]]
        if not isinstance(layer, LoRALayer):
            raise TypeError(
                f"FedDAT's DAT needs LoRA layers; '{name}' belongs to a "
                f"{type(layer).__name__}, which has no second branch"
            )
        if layer.branch is None:
            layer.add_branch(local_weight, 1.0 - local_weight)
    dat._index = None  # new parameters: the group index is rebuilt on demand
    dat.load_tensors({branch_name(n): t for n, t in client.items()})
    return dat


class MutualPair(TunedModel):
    """The model holding A_s and the DAT, side by side, trained together by MKD."""

    def __init__(self, shared: TunedModel, dat: TunedModel) -> None:
        super().__init__()
        self.shared = shared
        self.dat = dat

    def parameters_named(self, names: Iterable[str]) -> dict[str, nn.Parameter]:
        """The parameters called ``names`` (``shared.<name>`` or ``dat.<name>``)."""
        params = dict(self.named_parameters())
        wanted = list(names)
        unknown = [n for n in wanted if n not in params]
        if unknown:
            raise KeyError(f"no parameter named {unknown[:3]}")
        return {n: params[n] for n in wanted}


def _detached(out: TaskOutput) -> TaskOutput:
    return dataclasses.replace(out, outputs=out.outputs.detach())


def mutual_distillation(
    shared: Mapping[str, TaskOutput],
    dat: Mapping[str, TaskOutput],
    batch_size: int,
    temperature: float,
    weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """MKD on one batch's per-pair outputs (``TaskOutput``s of A_s and of the DAT): (L_s, L_c,
    statistic sums); L = sum_o (n_o / B) (loss_o + weight * c_o * KD_o) / 2 with c_o = T^2 for
    the KL terms and 1 for images, the other side's outputs detached."""

    loss_s = loss_c = torch.zeros(())
    sums: dict[str, float] = {}
    for task, s in shared.items():
        d = dat[task]
        scale = weight * (1.0 if PAIRS[task].kind == IMAGE_GENERATION else temperature**2)
        kd_s = distillation_loss(s, _detached(d), temperature)
        kd_c = distillation_loss(d, _detached(s), temperature)
        share = s.count / batch_size
        loss_s = loss_s + share * 0.5 * (s.loss + scale * kd_s)
        loss_c = loss_c + share * 0.5 * (d.loss + scale * kd_c)
        sums[f"loss-{task}"] = s.loss.item() * s.count
        sums[f"count-{task}"] = float(s.count)
        sums[f"dat-loss-{task}"] = d.loss.item() * s.count
        sums[f"mkd-shared-{task}"] = kd_s.item() * s.count
        sums[f"mkd-dat-{task}"] = kd_c.item() * s.count
    return loss_s, loss_c, sums


class MutualDistillationTask(TrainingObjective):
    """The multi-task task whose training step is MKD on a ``MutualPair`` (L_s + L_c)."""

    def __init__(self, task: Task, temperature: float, weight: float) -> None:
        super().__init__(task)
        self.temperature = temperature
        self.weight = weight

    def step(self, model: nn.Module, batch: Batch) -> StepResult:
        """L_s + L_c of ``model`` (a ``MutualPair``) on one batch: one forward of each side."""

        size = len(batch[0])
        shared = task_outputs(model.shared, batch)
        dat = task_outputs(model.dat, batch)
        loss_s, loss_c, sums = mutual_distillation(shared, dat, size, self.temperature, self.weight)
        return StepResult(loss_s + loss_c, size, sums)


class FedDATClient(ClientLogic):
    """A_s trained by MKD and sent; A_c trained by MKD inside the DAT and kept with A_g."""

    def settings(self, runtime: ClientRuntime) -> FedDATSettings:
        """This run's ``feddat-*`` settings."""
        return runtime.config.settings_of(FedDATSettings)

    def start(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor]
    ) -> tuple[TunedModel, list[str], dict[str, torch.Tensor]]:
        """(the model holding ``received``, the client's component names, their seeded initial
        values: A_c's start)."""
        model = runtime.model()
        names = model.names_for(runtime.task.holdings(runtime.data))
        initial = model.tensors_named(names)
        model.load_tensors(received)
        return model, names, initial

    def personal(
        self, runtime: ClientRuntime, **lookup: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
        """(A_c, A_g) from client state, or None before the client has trained."""
        state = runtime.store.load(**lookup)
        if state is None:
            return None
        client = {k[len(CLIENT) :]: v for k, v in state.items() if k.startswith(CLIENT)}
        frozen = {k[len(GLOBAL) :]: v for k, v in state.items() if k.startswith(GLOBAL)}
        return client, frozen

    def mutual_distillation(
        self,
        runtime: ClientRuntime,
        received: dict[str, torch.Tensor],
        client: dict[str, torch.Tensor] | None,
        seed: int,
        steps: int | None = None,
    ) -> tuple[TunedModel, TunedModel, list[str], TrainStats]:
        """A_g := ``received``; MKD trains A_s (from ``received``) and A_c (from ``client``, or
        its seeded start when None) for the local schedule or ``steps``; returns (the model
        holding A_s, the DAT, the client's component names, the statistics)."""
        settings = self.settings(runtime)
        model, names, initial = self.start(runtime, received)
        if client is None:
            client = {n: initial[n] for n in lora_names(names)}
        dat = dual_adapter_teacher(model, names, client, settings.local_weight)
        pair = MutualPair(model, dat)
        trained = [f"shared.{n}" for n in names] + [f"dat.{branch_name(n)}" for n in client]
        mkd = MutualDistillationTask(runtime.task, settings.temperature, settings.distill_weight)
        stats = runtime.train(pair, trained, seed, steps=steps, task=mkd)
        return model, dat, names, stats

    def train(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> tuple[dict[str, torch.Tensor], TrainStats]:
        """A_g := the received components; MKD trains A_s and A_c; send A_s, keep A_c and A_g."""
        state = self.personal(runtime, before=server_round)
        model, dat, names, stats = self.mutual_distillation(
            runtime, received, state[0] if state else None, runtime.seed(server_round)
        )
        client = lora_names(names)
        kept = dat.tensors_named(branch_name(n) for n in client)
        frozen = dat.tensors_named(names)  # A_g, as received
        runtime.store.save(
            server_round,
            {
                **{CLIENT + n: kept[branch_name(n)] for n in client},
                **{GLOBAL + n: t for n, t in frozen.items()},
            },
        )
        return model.tensors_named(names), stats

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """The DAT (A_g of the latest training round with A_c); the received global adapter
        before the client has trained."""
        model, names, _ = self.start(runtime, received)
        state = self.personal(runtime, at_most=server_round)
        if state is None:
            return runtime.evaluate(model)
        client, frozen = state
        model.load_tensors(frozen)
        dat = dual_adapter_teacher(model, names, client, self.settings(runtime).local_weight)
        return runtime.evaluate(dat)


class FedDATFineTuneClient(FedDATClient):
    """FedDAT + Post-train (TAP's baseline): before an evaluation, a copy runs ``finetune-steps``
    more iterations of FedDAT's local training from the received global, then the DAT is
    evaluated; nothing is kept."""

    def evaluate(
        self, runtime: ClientRuntime, received: dict[str, torch.Tensor], server_round: int
    ) -> EvalStats:
        """MKD for the fine-tuning schedule (A_g := A_s := ``received``, A_c from client state),
        then the DAT's evaluation."""
        state = self.personal(runtime, at_most=server_round)
        _, dat, _, _ = self.mutual_distillation(
            runtime,
            received,
            state[0] if state else None,
            runtime.seed(server_round, salt=2),
            steps=runtime.config.finetune_steps,
        )
        return runtime.evaluate(dat)
