"""Ditto (Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021): FedAvg of a global model w, and a personal model v_k per client
pulled towards the global one.

Algorithm 1, round t: the server sends w^t (FedAvg's global model) to the selected clients; each
client k (a) updates w^t with its usual local solver (FedAvg's client update) and sends the
result back, where the server averages the replies by examples (FedAvg); (b) updates its
personal model for s local iterations with

    v_k <- v_k - eta * (grad F_k(v_k) + lambda * (v_k - w^t)),

the gradient of F_k(v_k) + lambda/2 ||v_k - w^t||^2, where w^t is the global model it received
this round, not the one it has just updated. Evaluation uses v_k. The client half is
``client_apps.ditto``.

Hyper-parameters and the choices made here:

* ``ditto-lambda`` (lambda): default 0.1, the value pFedSeq's Appendix B sets for its Ditto row
  (tuned over {0.01, 0.1, 1, 10}); the Ditto paper picks it per device from {0.1, 1, 2}
  (from {0.05, 0.1, 0.2} under strong attacks) and its authors' clean runs use 1
  (github.com/litian96/ditto, ``run_*_clean_ditto_lam1.sh``). ``lambda = 0`` leaves v plain
  local training; a large lambda holds v at w^t.
* What trains: w and v are every trainable tensor of the run (adapter and head, or what the
  run trains), as for FedAvg; pFedSeq compares every baseline on the same LoRA + head, so the
  tuner is LoRA. w travels, v stays in the client's state.
* v's schedule: ``ditto-personal-steps`` batches when > 0, else ``ditto-personal-epochs``
  epochs when > 0, else (the default) the run's local schedule (``local-epochs`` /
  ``local-steps``): the authors' code takes s = its global local iterations, PFLlib's
  ``plocal_epochs`` defaults to 1 as its local epochs do. v's pass draws the same batches in the
  same order as w's (the same round seed), as the authors' code steps both on each batch.
* v's solver: the run's optimizer (fresh each round, as w's) on the loss plus
  lambda/2 ||v - w^t||^2 (``fedfm_flower.tasks.training.proximal_term``), at ``ditto-personal-lr``
  (0: the run's ``lr``). Algorithm 1, the authors' code and PFLlib step w and v with the same
  solver at the same step size; w must be FedAvg's client update here, i.e. the run's
  optimizer, so v takes it too. With ``optimizer = sgd``, ``momentum = 0`` and
  ``weight-decay = 0`` (the paper-table setups) the step is the rule above exactly.
* v's start: the model's seeded initial values, which are the server's initial w^0 (the
  paper's v_k^0 = w^0; the authors' code and PFLlib copy the initial model). A client never
  trained evaluates w^0, as there. With every client in every round this is the same as
  starting from the first received global model (w^1 = w^0).
* Order: w's update first (bit for bit FedAvg's: same seed, same batches), then v's; either
  order gives the same result since v's anchor is the received w^t.
* Reported training statistics: v's loss and metrics; examples, steps and seconds of both
  passes together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, ResourceProfile, Split
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, setting


@dataclass(frozen=True)
class DittoSettings(MethodSettings):
    """Ditto's keys: field ``lambda_`` is run-config key ``ditto-lambda``, ``personal_epochs``
    is ``ditto-personal-epochs``."""

    prefix: ClassVar[str] = "ditto"

    # The proximal weight (a trailing underscore: ``lambda`` is a Python keyword).
    lambda_: float = setting(
        0.1,
        non_negative=True,
        doc=(
            "Ditto's proximal weight lambda pulling the personal model towards the received "
            "global one (>= 0; pFedSeq sets 0.1 of {0.01, 0.1, 1, 10}, the Ditto paper picks "
            "from {0.1, 1, 2}); 0 trains the personal model alone"
        ),
    )
    personal_epochs: int = setting(
        0,
        non_negative=True,
        doc=(
            "epochs of the personal model per round; `0`: the run's local schedule "
            "(`local-epochs` / `local-steps`), as the authors' code"
        ),
    )
    personal_steps: int = setting(
        0,
        non_negative=True,
        doc="> 0: that many batches of the personal model per round instead of epochs",
    )
    personal_lr: float = setting(
        0.0,
        non_negative=True,
        doc="step size of the personal model; `0` means the run's `lr` (Algorithm 1's one eta)",
    )

    def schedule(self, epochs: int, steps: int) -> tuple[int, int]:
        """(epochs, steps) of the personal model's pass, given the run's local schedule."""
        if self.personal_steps > 0:
            return 0, self.personal_steps
        if self.personal_epochs > 0:
            return self.personal_epochs, 0
        return epochs, steps

    def personal_step(self, lr: float) -> float:
        """The personal model's step size: ``ditto-personal-lr``, or the run's ``lr`` when 0."""
        return self.personal_lr or lr


# Tuned besides the common training keys (fedfm_flower.study.search): lambda over the ends of
# pFedSeq's grid {0.01, 0.1, 1, 10} (its Appendix B, the table this row belongs to), which holds
# the Ditto paper's per-device choices {0.05, 0.1, 0.2} and {0.1, 1, 2}.
SEARCH = {"ditto-lambda": LogUniform(0.01, 10.0)}

SPECS = (
    MethodSpec(
        "ditto",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.ditto:DittoClient",
        summary="FedAvg of w; a personal v per client trained with a proximal pull "
        "lambda/2 ||v - w_global||^2, evaluates v (Li et al. 2021)",
        settings=DittoSettings,
        split=Split(shared=None, local=()),
        # w travels; v (a second copy of every trainable tensor) stays on the client, and each
        # round passes the data twice (w's schedule, then v's: the same one by default).
        profile=ResourceProfile(copies=2, passes=2),
        search=SEARCH,
        # The server is FedAvg's: it needs only the average of the clients' w.
        capabilities=AVERAGE_ONLY,
    ),
)
