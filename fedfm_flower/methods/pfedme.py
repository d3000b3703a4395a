"""pFedMe (Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020): each client's personalized model theta_i is the proximal point of its loss
around its local copy w_i of the global model; the server moves the global model towards the
average of the w_i.

Algorithm 1, round t: the server sends w^t; each selected client i sets w_i = w^t and, for R
local rounds (a batch each), (a) solves approximately, with K gradient steps of size
``personal_lr`` on the batch,

    theta_i = argmin_theta f_i(theta; batch) + lambda/2 ||theta - w_i||^2,
    i.e. theta <- theta - personal_lr * (grad f_i(theta; batch) + lambda (theta - w_i)),

then (b) takes the outer step w_i <- w_i - eta * lambda * (w_i - theta_i). It sends w_i; the
server sets w^{t+1} = (1 - beta) w^t + beta * mean_i(w_i) (``strategies.pfedme``; beta = 1 is
FedAvg of the w_i). Evaluation uses theta_i, the client's last inner solution. The client half
is ``client_apps.pfedme``.

Hyper-parameters and the choices made here:

* ``pfedme-lambda`` (lambda): default 15, the authors' MNIST setting (their README's command,
  github.com/CharlieDinh/pFedMe: ``--learning_rate 0.005 --personal_learning_rate 0.09 --beta 1
  --lamda 15``) and PFLlib's default. pFedSeq's Appendix B names no lambda of its own (it tunes
  only pFedMe's local learning rate).
* ``pfedme-inner-steps`` (K): default 5, the paper's and PFLlib's.
* ``pfedme-personal-lr``: the inner step size; 0 (default) means the run's ``lr``. The authors'
  MNIST command sets 0.09 beside an outer 0.005, PFLlib defaults to 0.01; pFedSeq's Appendix B tunes
  "the local learning rate" of pFedMe in {0.001, 0.005, 0.01, 0.05} (0.01 DomainNet and
  Omniglot, 0.005 CIFAR-100 and Tiny-ImageNet) and names no second rate, so by default the one
  tuned ``lr`` drives both steps. The outer step eta is always the run's ``lr`` (PFLlib's
  ``learning_rate``).
* ``pfedme-beta`` (beta): default 1.0 (the authors' MNIST command and PFLlib's: the server
  averages); beta in (0, 1) damps the step, beta > 1 extrapolates it.
* The inner solve starts at w^t each round and warm-starts from the previous theta_i on each
  later batch (theta is not reset to w_i), as the authors' code and PFLlib, whose model holds
  theta across batches. Each inner step draws the same batch (Algorithm 1: one batch per local
  round).
* No weight decay inside the inner step: the authors' code and PFLlib's ``pFedMeOptimizer``
  add ``mu * theta`` (mu = 0.001) to the gradient, a term Algorithm 1 does not have; the run's
  ``weight-decay`` does not apply either. All steps are plain SGD (the run's optimizer and
  momentum keys do not apply), as in the paper.
* R, the local rounds: the run's local schedule (``local-steps`` batches when > 0, else
  ``local-epochs`` passes), the batches in the round's seeded order.
* What trains: every trainable tensor of the run (adapter and head, or what the run trains),
  as for FedAvg; pFedSeq compares every baseline on the same LoRA + head. w_i travels, theta_i
  stays in the client's state.
* Server weights: the mean of the w_i is weighted by training examples, as the house FedAvg
  and PFLlib's ``aggregate_parameters``; the paper's Algorithm 1 writes the plain mean over the
  selected clients (the same with equal-sized clients).
* theta's start for a client never trained: the model's seeded initial values, the server's
  w^0 (PFLlib copies the initial model into its personalized parameters).
* Reported training statistics: theta's loss and metrics at the last inner step of each batch
  (its examples counted once per batch); steps count batches (each costs K forward-backward
  passes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, ResourceProfile, Split
from fedfm_flower.methods.ranges import LogUniform, Uniform
from fedfm_flower.methods.settings import MethodSettings, setting


@dataclass(frozen=True)
class PFedMeSettings(MethodSettings):
    """pFedMe's keys: field ``lambda_`` is run-config key ``pfedme-lambda``, ``inner_steps`` is
    ``pfedme-inner-steps``."""

    prefix: ClassVar[str] = "pfedme"

    # The Moreau-envelope weight (a trailing underscore: ``lambda`` is a Python keyword).
    lambda_: float = setting(
        15.0,
        non_negative=True,
        doc=(
            "pFedMe's Moreau-envelope weight lambda tying the personalized model theta to the "
            "local w (>= 0; the paper's MNIST value and PFLlib's default 15, 20 on Synthetic)"
        ),
    )
    inner_steps: int = setting(
        5,
        positive=True,
        doc="K, gradient steps of the inner problem per batch (the paper's and PFLlib's 5)",
    )
    personal_lr: float = setting(
        0.0,
        non_negative=True,
        doc=(
            "step size of the inner steps on theta; `0` means the run's `lr` (pFedSeq tunes one "
            "local learning rate; the paper sets 0.1 / 0.01, PFLlib 0.01)"
        ),
    )
    beta: float = setting(
        1.0,
        positive=True,
        doc=(
            "server step: w <- (1 - beta) w + beta * mean(w_i); `1` is FedAvg of the local "
            "models (PFLlib's default), the paper also runs 2"
        ),
    )

    def personal_step(self, lr: float) -> float:
        """The inner step size: ``pfedme-personal-lr``, or the run's ``lr`` when 0."""
        return self.personal_lr or lr


# Tuned besides the common training keys (fedfm_flower.study.search; lr is pFedSeq's one tuned key
# for this row): lambda around the paper's values (15 and 20, studied up to 30), beta over the
# paper's two settings {1, 2}.
SEARCH = {"pfedme-lambda": LogUniform(5.0, 50.0), "pfedme-beta": Uniform(1.0, 2.0)}

SPECS = (
    MethodSpec(
        "pfedme",
        strategy="strategies.pfedme:PFedMeStrategy",
        client="client_apps.pfedme:PFedMeClient",
        summary="a personalized theta per client, the Moreau-envelope proximal point of its "
        "local w (K inner steps); server w <- (1 - beta) w + beta mean(w_i), evaluates theta "
        "(Dinh et al. 2020)",
        settings=PFedMeSettings,
        split=Split(shared=None, local=()),
        # w_i travels; theta_i (a second copy of every trainable tensor) stays on the client;
        # each batch takes K forward-backward passes (5 by default).
        profile=ResourceProfile(copies=2, passes=5),
        search=SEARCH,
        # The server needs only the (weighted) average of the clients' w_i; the beta step is
        # post-processing of that average (w^t is public), so central DP's guarantee and
        # SecAgg+'s sum-only view hold (under central DP the noise is scaled by beta too).
        capabilities=AVERAGE_ONLY,
    ),
)
