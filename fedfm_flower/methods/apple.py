"""APPLE (Luo, Wu, "Adapt to Adaptation: Learning Personalization for Cross-Silo Federated
Learning", IJCAI 2022): each client keeps a *core model* that it shares and a *directed
relationship* (DR) vector that stays local, and trains the mixture of every client's core that
the vector weighs.

The rule. Client i holds its core theta_i (here: the run's trainable tensors, LoRA adapter and
head on the frozen ViT, as pFedSeq compares every baseline on) and p_i in R^N. Its personalized
model is

    w_i = sum_j p_ij theta_j

over the cores theta_j of all N clients as it downloaded them. Round r (0-based: Flower's
round t is r = t - 1), on every batch of the local schedule, theta_i and p_i descend the loss

    F_i(w_i) + lambda(r) * mu / 2 * ||p_i - p_0||^2

where theta_j (j != i) are fixed, so dF/dtheta_i = p_ii grad F(w_i) and
dF/dp_ij = <grad F(w_i), theta_j> (summed over every element of every tensor). The loss
scheduler lambda(r) falls from 1 to 0 over the first L rounds and is 0 after:

    cosine:       lambda(r) = (cos(pi r / L) + 1) / 2     for r < L
    exponential:  lambda(r) = 0.001 ** (r / L)            for r < L

so early rounds hold p_i near p_0 (a FedAvg-like mixture: the global objective) and later ones
let it go where the local data leads (the local objective). The client sends theta_i; the server
stores it in client i's slot and sends every client the latest cores. Evaluation uses w_i. The
halves: ``strategies.apple`` (one slot per client) and ``client_apps.apple``.

Sources: the paper's abstract and workflow figure (its full text could not be read where this
was written), the authors' code (github.com/ljaiverson/pFL-APPLE: ``train_APPLE.py``,
``utils/losses.py``, ``utils/apple.py``), PFLlib's ``clientapple.py``/``serverapple.py`` (the
codebase of pFedSeq's table) and FLGo's port (``algorithm/apple.py``). The rule above is the
authors' code's (its ``ClientNet`` mixes each layer's outputs by p, which for linear and
convolutional layers is mixing their weights) and the ports'; where they differ, the choice is
stated below.

Hyper-parameters and the choices made here:

* ``apple-p-lr``: the DR vector's learning rate, default 0.001: pFedSeq's Appendix B setting
  ("the learning rate for the aggregation weights (also termed the directed relationship
  vector) to 0.001, after tuning from {0.001, 0.01, 0.1, 1.0}"), also the authors' default
  (``--lr_coef 0.001``, github.com/ljaiverson/pFL-APPLE). 0 keeps p_i at p_0.
* ``apple-mu``: mu, default 0.1 (the authors' ``--mu``). The term is lambda(r) mu/2 ||.||^2,
  as PFLlib's ``clientapple.py`` steps it (gradient lambda mu (p - p_0)) and FLGo writes it
  (0.5 mu); the authors' ``reg_loss`` leaves out the 1/2, so their mu is this mu / 2.
  PFLlib's ``-mu`` defaults to 0, which drops the term altogether.
* ``apple-schedule``: ``cosine`` (default: PFLlib's and FLGo's, the authors' ``--scheduler
  cosine``) or ``exponential`` (the authors' code default, epsilon = 0.001 as there).
* ``apple-schedule-fraction``: L as a fraction of ``num-server-rounds``, default 0.1 (the
  authors' ``--reg_last_round_over_total_round``, FLGo's ``ratioL``; PFLlib's ``-L`` defaults
  to 1.0, the whole run). L = max(1, int(fraction * rounds)): the authors' int(), but at least
  one round, so a short run still starts at lambda = 1 (their int() gives L = 0, no term at
  all, below 10 rounds).
* p_0, which is both p_i's initial value and the proximal anchor, is the uniform vector 1/N.
  The authors (and FLGo) take the clients' shares of the training data, n_j / n, for both;
  PFLlib starts p_i at 1/N and anchors it at n_j / n. Here no client knows the others' data
  sizes before its first round (the identity query carries none, and round 1 needs p_0), so
  the uniform vector, which equals n_j / n for equal partitions, serves for both.
* Solver: the run's optimizer (``optimizer``, ``momentum``, ``weight-decay``), fresh each
  round, over two parameter groups: theta_i at ``lr`` and p_i at ``apple-p-lr`` without weight
  decay (a decay would pull p_i to 0, not to p_0). The authors step both with one SGD
  (momentum 0.9) at their two rates; with ``optimizer = sgd``, ``momentum = 0`` and
  ``weight-decay = 0`` it is the plain gradient step above. theta_i's step is the exact
  p_ii-scaled gradient: PFLlib multiplies its core learning rate by N to make up for
  p_ii ~ 1/N; here ``lr``, tuned over 30x each way, takes that up. p's gradient is the exact
  one; PFLlib's averages g * theta_j per element and per tensor instead, a step smaller by
  roughly the core's size, which is why the search below reaches well under pFedSeq's grid.
* What travels: every round the server sends client i ALL N cores (its own under the plain
  parameter names, the others' under ``core_key``): the authors' default downloads every core
  (their bandwidth limit M, ``--limit_downloaded_models``, defaults to 10000), as PFLlib does.
  The limited-download variant (M cores per round, sampled by |p_ij|, stale copies kept on
  the client) is not implemented. Bytes down are N times bytes up.
* Initial cores: every slot starts at the run's seeded initial tensors (PFLlib's and FLGo's
  copies of one model; the authors draw a different random core per client, for CNNs trained
  from scratch).
* p_i is unconstrained (no simplex projection, entries may turn negative), as in all three
  codes (the authors' download sampling weighs cores by |p_ij| for that reason). It stays on
  the client (client state); the server never sees it.
* Evaluation: w_i from the cores the client is sent for its next round and its latest p_i
  (the model its next round starts from); a client never trained evaluates with p_0.
* Reported training statistics: the task's loss and metrics of w_i (the proximal term left
  out, as for every method here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import Capabilities, MethodSpec, ResourceProfile, Split
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, RunConfig, setting

SCHEDULES: tuple[str, ...] = ("cosine", "exponential")
EXPONENTIAL_END = 1e-3  # the exponential scheduler's lambda at r = L (the authors' epsilon)

CORE_PREFIX = "apple-core/"  # payload key of client j's core tensor n: "apple-core/<j>/<n>"


def core_key(client_id: int, name: str) -> str:
    """The payload key of tensor ``name`` of client ``client_id``'s core."""
    return f"{CORE_PREFIX}{client_id}/{name}"


def parse_core_key(key: str) -> tuple[int, str] | None:
    """(client id, tensor name) of a ``core_key``; None for any other key."""
    if not key.startswith(CORE_PREFIX):
        return None
    client, _, name = key[len(CORE_PREFIX) :].partition("/")
    if not client.isdigit() or not name:
        raise ValueError(f"malformed APPLE core key '{key}'")
    return int(client), name


@dataclass(frozen=True)
class AppleSettings(MethodSettings):
    """APPLE's keys: field ``p_lr`` is run-config key ``apple-p-lr``, ``schedule_fraction`` is
    ``apple-schedule-fraction``."""

    prefix: ClassVar[str] = "apple"

    p_lr: float = setting(
        0.001,
        non_negative=True,
        doc=(
            "learning rate of the directed relationship vector p_i (>= 0; pFedSeq sets 0.001 of "
            "{0.001, 0.01, 0.1, 1.0}, the authors' default); `0` keeps p_i at p_0"
        ),
    )
    mu: float = setting(
        0.1,
        non_negative=True,
        doc=(
            "weight mu of the proximal term lambda(r) mu/2 times the squared L2 distance of p_i "
            "to p_0 (>= 0; the authors' 0.1); `0` drops it"
        ),
    )
    schedule: str = setting(
        "cosine",
        choices=SCHEDULES,
        doc=(
            "shape of the loss scheduler lambda(r), 1 at round 1 and 0 from round L + 1: "
            "`cosine` ((cos(pi r/L) + 1)/2, PFLlib's) or `exponential` (0.001^(r/L), the "
            "authors' code default)"
        ),
    )
    schedule_fraction: float = setting(
        0.1,
        within=(0.0, 1.0),
        bounds="(]",
        doc=(
            "L as a fraction of num-server-rounds: L = max(1, int(fraction * rounds)) rounds "
            "of the proximal term (the authors' 0.1)"
        ),
    )

    def decay_rounds(self, num_rounds: int) -> int:
        """L: the rounds over which lambda(r) falls to 0 (at least 1)."""
        return max(1, int(self.schedule_fraction * num_rounds))

    def proximal_weight(self, server_round: int, num_rounds: int) -> float:
        """lambda(r) of Flower round ``server_round`` (r = server_round - 1) in a run of
        ``num_rounds`` rounds: 1 at r = 0, falling to 0 at r = L, 0 after."""
        r, span = server_round - 1, self.decay_rounds(num_rounds)
        if r >= span:
            return 0.0
        if self.schedule == "cosine":
            return (math.cos(math.pi * r / span) + 1.0) / 2.0
        return EXPONENTIAL_END ** (r / span)


# Tuned besides the common training keys (fedfm_flower.study.search): p's learning rate over
# pFedSeq's grid {0.001, 0.01, 0.1, 1.0} (its Appendix B) and two decades below it: pFedSeq chose
# the grid's bottom, and its PFLlib step is the exact gradient's divided by about the core's size.
SEARCH = {"apple-p-lr": LogUniform(1e-5, 1.0)}

CAPABILITIES = Capabilities(
    central_dp="its server stores each client's own core and passes it to every other client; "
    "DP-FedAvg noises an average, which APPLE never forms",
    local_dp=None,  # each core is clipped and noised around the one received before it leaves
    secagg="its clients mix every other client's individual core, and SecAgg+ reveals only "
    "the sum of the cores",
)


def apple_copies(config: RunConfig) -> int:
    """A training client holds all N cores and their mixture w_i."""
    return config.num_clients + 1


def apple_traffic(config: RunConfig, shared: int, classes: int) -> tuple[int, int]:
    """Up: the client's core; down: all N cores (APPLE's download grows with the clients)."""
    return shared, config.num_clients * shared


SPECS = (
    MethodSpec(
        "apple",
        strategy="strategies.apple:AppleStrategy",
        client="client_apps.apple:AppleClient",
        summary="each client trains its shared core and a local directed relationship vector "
        "p_i weighing every client's core, w_i = sum_j p_ij theta_j, with a scheduled "
        "proximal pull of p_i to p_0 (Luo & Wu 2022)",
        settings=AppleSettings,
        # The core (every trainable tensor) travels; p_i stays in the client's state.
        split=Split(shared=None, local=()),
        # While training a client holds N cores and their mixture (N + 1 copies) and the N
        # entries of p_i (not counted: N scalars).
        profile=ResourceProfile(copies=apple_copies, traffic=apple_traffic),
        message_prefix=CORE_PREFIX,
        search=SEARCH,
        capabilities=CAPABILITIES,
        no_batchnorm=(
            "its clients mix the other clients' cores parameter by parameter (w_i = sum_j p_ij "
            "theta_j); how a BatchNorm's running statistics mix is not defined by the paper nor "
            "here yet"
        ),
    ),
)
