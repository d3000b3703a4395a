"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma, Guan, "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning", AAAI 2023): FedAvg on the server; each client initialises its
local model by an Adaptive Local Aggregation (ALA) of the received global model and its own
before training.

Round t on client i (Algorithm 1; the authors' ``system/utils/ALA.py`` in
github.com/TsingZ0/FedALA, the same in PFLlib): the client receives Theta^t and holds its local
model theta_i (the model it trained and sent in its last round). ALA forms

    theta_hat = theta_i + (Theta^t - theta_i) * W_i          (element-wise, on the top p layers)

and takes Theta^t as it is on the lower layers. The weights W_i (one per element of the top
layers, initialised to 1, kept by the client across rounds, never sent) are learnt by SGD with
theta_i and Theta^t fixed, on a random s-fraction of the local training data:

    W <- clip(W - eta * dL/dtheta_hat * (Theta^t - theta_i), 0, 1)

after every batch, theta_hat recomputed from the new W. The client then trains theta_hat with
the run's local schedule (FedAvg's client update, ``SplitClient.local_training``) and sends the
result, which becomes its theta_i. The server averages the replies by examples (FedAvg). The
client half is ``client_apps.fedala``.

Hyper-parameters and the choices made here:

* "Layers" are the run's trainable parameter tensors in the model's parameter order (LoRA
  adapter and head on the frozen ViT by default), and ``fedala-layers`` p counts TENSORS, as the
  authors' ``layer_idx`` does (``params[-layer_idx:]`` of ``model.parameters()``): the head's
  weight and bias are the top 2, so the paper's "p = 1" (its top layer, weight and bias) is
  p = 2 here, the authors' code default (``main.py -p 2``, "more fine-grained than its original
  paper"). p = 0 (the default) takes every trainable tensor, as the authors' ``layer_idx = 0``
  ("by default, all the layers are selected": ``params[-0:]`` is all of them, ``params[:-0]``
  none) and as pFedSeq's Appendix B, whose FedALA row "applies ALA to the adapters attached at
  all layers of the backbone" (with the head: pFedSeq shares LoRA and head for every method).
  p larger than the number of tensors also takes all of them.
* ``fedala-eta`` (W's step size): default 0.1, pFedSeq's Appendix B setting (tuned over
  {0.001, 0.01, 0.1, 1.0}); the FedALA paper and its authors' code use 1.0.
* ``fedala-sample-ratio`` s: 0.8, the paper's s = 80% and the authors' ``rand_percent = 80``.
  The sample is, as in the authors' code, ``int(s * N)`` CONSECUTIVE training examples from a
  random start (seeded per client and round), batched in order (no shuffle, last batch kept) at
  the run's ``batch-size``.
* Convergence: in a client's first ALA (the paper's "start phase") W trains epoch after epoch
  over the sample until more than ``fedala-num-pre-loss`` epoch losses are recorded and the
  (population) standard deviation of the last ``fedala-num-pre-loss`` is below
  ``fedala-threshold``; the recorded loss of an epoch is its LAST batch's, as the authors'
  code records it. Later ALAs train W one epoch. ``fedala-num-pre-loss`` = 10 is the authors'
  default; ``fedala-threshold`` = 1.0 is pFedSeq's Appendix B setting ("to avoid long training
  time of ALA optimization"; the authors' default is 0.1). ``fedala-max-epochs`` caps the start
  phase (0: no cap, as the authors').
* The first round: the authors' code skips ALA while the received model equals the local one
  (their test: ``sum(params_g[0] - params[0]) == 0``), which holds in a client's first round,
  where its local model is the initial one, the server's Theta^0 (the start phase then begins
  in its next round). Here a client never trained holds the model's seeded initial values (the
  server's initial Theta^0) and ALA is skipped while the received top tensors equal the local
  ones exactly: then theta_hat = Theta whatever W, and W's gradient is 0, so skipping changes
  nothing but the cost, and the start phase waits for the first ALA that runs.
* W's mixing uses ``torch.lerp(theta, Theta, W)``: the rule above, with W = 1 giving Theta and
  W = 0 theta bit for bit, so with W = 1 and eta = 0 a client starts from Theta exactly
  (FedAvg's client update).
* ALA's forward passes run the model in training mode (dropout seeded per client and round), as
  the authors' copy of the model trained last round.
* Evaluation: theta_hat of the received model with the client's current W (W is not trained
  at evaluation, which leaves client state untouched; the authors evaluate after the next
  round's ALA, one more epoch of W). A client never trained evaluates the received model.
* What is kept: the sent top-p tensors (theta_i's lower layers are never used) and W.
* Reported training statistics: the local training's loss and metrics; examples, steps and
  seconds of ALA's W passes and the local training together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, ResourceProfile, Split
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, setting


@dataclass(frozen=True)
class FedALASettings(MethodSettings):
    """FedALA's keys: field ``layers`` is run-config key ``fedala-layers``, ``sample_ratio`` is
    ``fedala-sample-ratio``."""

    prefix: ClassVar[str] = "fedala"

    layers: int = setting(
        0,
        non_negative=True,
        doc=(
            "p: ALA mixes the last p trainable tensors in model order (the head's weight and "
            "bias are the top 2, the paper's top layer); the rest take the global values. "
            "`0`: every trainable tensor (the authors' default, pFedSeq's setting)"
        ),
    )
    sample_ratio: float = setting(
        0.8,
        within=(0.0, 1.0),
        bounds="(]",
        doc="s: the fraction of the local training data W learns on (the paper's 80%)",
    )
    eta: float = setting(
        0.1,
        non_negative=True,
        doc=(
            "W's SGD step size (pFedSeq sets 0.1 of {0.001, 0.01, 0.1, 1.0}; the paper 1.0); "
            "`0` keeps W at its start"
        ),
    )
    threshold: float = setting(
        1.0,
        non_negative=True,
        doc=(
            "the start phase trains W until the std of its recent epoch losses is below this "
            "(pFedSeq's 1.0; the authors' default 0.1)"
        ),
    )
    num_pre_loss: int = setting(
        10,
        positive=True,
        doc="how many recent epoch losses the convergence test takes (the authors' 10)",
    )
    max_epochs: int = setting(
        0,
        non_negative=True,
        doc="> 0: at most that many W epochs in the start phase; `0`: no cap (the authors')",
    )

    def top(self, names: list[str]) -> list[str]:
        """The names ALA mixes: the last ``layers`` of ``names`` (all of them when 0)."""
        return list(names[-self.layers :]) if self.layers > 0 else list(names)

    def converged(self, losses: list[float]) -> bool:
        """The authors' test: more than ``num_pre_loss`` losses, the last ``num_pre_loss`` of
        (population) standard deviation below ``threshold``."""
        if len(losses) <= self.num_pre_loss:
            return False
        recent = losses[-self.num_pre_loss :]
        mean = sum(recent) / len(recent)
        return (sum((x - mean) ** 2 for x in recent) / len(recent)) ** 0.5 < self.threshold


# Tuned besides the common training keys (fedfm_flower.study.search): W's step size over pFedSeq's
# grid {0.001, 0.01, 0.1, 1.0} (its Appendix B, the table this row belongs to), which holds the
# FedALA paper's 1.0.
SEARCH = {"fedala-eta": LogUniform(0.001, 1.0)}

SPECS = (
    MethodSpec(
        "fedala",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.fedala:FedALAClient",
        summary="FedAvg; each client starts from an adaptive element-wise mix "
        "theta + (Theta - theta) * W of the global and its local model, W learnt on local "
        "data and kept (Zhang et al. 2023)",
        settings=FedALASettings,
        split=Split(shared=None, local=()),
        # The local model's top tensors and W (each as large) stay on the client; ALA passes
        # s of the data (once per round after the start phase) besides the local training.
        profile=ResourceProfile(copies=2, passes=2),
        search=SEARCH,
        # The server is FedAvg's: it needs only the average of the clients' models.
        capabilities=AVERAGE_ONLY,
        no_batchnorm=(
            "its element-wise aggregation weights are learnt on parameters; what ALA does with a "
            "BatchNorm's running statistics is not defined by the paper nor here yet"
        ),
    ),
)
