"""pFedHN (Shamsian, Navon, Fetaya, Chechik, "Personalized Federated Learning using
Hypernetworks", ICML 2021): a server hypernetwork generates each client's parameters from a
learnable descriptor of that client.

Rule (Algorithm 1). The server holds a descriptor v_i per client and a hypernetwork h(.; phi)
(``fedfm_flower.learners.hypernetwork``). Client i is sent theta_i = h(v_i; phi), trains it for
the run's local schedule on its data to theta_i~ and sends Delta theta_i = theta_i~ - theta_i.
The server moves phi and v_i along the gradient proxy

    g = (d theta_i / d (phi, v_i))^T (theta_i - theta_i~)

(the chain rule through the hypernetwork, a vector-Jacobian product: one backward pass of
-<theta_i, Delta theta_i>), with Adam. Each client evaluates h(v_i; phi). The server half is
``fedfm_flower.learners.pfedhn`` and ``strategies.pfedhn``; the client is
``client_apps.updates.UpdateClient`` (pFedPG's and pFedSeq's client: it trains what it received
with its head, keeps the head and sends trained - received).

Hyper-parameters, from pFedSeq's Appendix B (its Table 1 row, on LoRA adapters of a frozen
ViT) and the authors' code (github.com/AvivSham/pFedHN):

* ``pfedhn-lr``: Adam's step of phi and the descriptors, 0.001 (pFedSeq's CIFAR-100,
  Tiny-ImageNet and DomainNet value, 0.0005 on Omniglot, tuned over {0.0001, 0.0005, 0.001,
  0.005, 0.01}; pFedSeq: "Adam optimizer is used for updating the hypernetworks").
* ``pfedhn-hidden`` 100 and ``pfedhn-layers`` 4: "a 4-layer MLP ... hidden size 100" from the
  descriptors to the client embedding (the authors' ``n_hidden = 3``: 1 + 3 Linear layers), then
  one Linear layer per generated tensor.
* ``pfedhn-embedding-dim``: the descriptor's size; 0 (default) is the authors' automatic
  int(1 + N / 4) for N clients. Descriptors start N(0, 1) (``nn.Embedding``'s init).
* ``pfedhn-clip``: the gradient's global L2 norm is clipped to 50 before Adam's step, as the
  authors' trainer and FL-bench do (0: no clipping).

Choices made here:

* **What is generated** (``pfedhn-head``). pFedSeq runs every baseline on LoRA + head, and for
  pFedHN describes the hypernetwork as generating "the adapter's parameters at each backbone
  layer"; the classification head is not a backbone layer. Default ``local``: the hypernetwork
  generates the LoRA adapter only, and each client trains its own head jointly with it and
  keeps it (the paper's own pFedHN-PC variant, "a personalized classifier" per client; how
  pFedSeq and pFedPG treat the head here). ``generated``: the adapter and the head are both
  generated (the paper's plain pFedHN, where h outputs the whole target network).
* **Several clients a round.** Algorithm 1 samples one client per hypernetwork step. Here the
  reporting clients' gradient proxies are averaged into one Adam step a round (the same
  hypernetwork generated all their theta_i, so each proxy is exact at that phi): PeFLL's
  authors' trainer does this for their ``clients_per_step`` (their code grew from pFedHN's), and
  pFedSeq's Table 4 describes its hypernetwork baselines as one server update a round. With one
  client a round (``fraction-train`` = 1/N) it is Algorithm 1's step exactly.
* **Partial participation.** Descriptors are one parameter per client: a client that does not
  report has no gradient and Adam skips its descriptor (an ``nn.Embedding`` table, as in the
  authors' code, would keep moving unsampled rows by Adam's momentum).
* **Initialisation**: ``HyperNetwork``'s output layers start at zero weights and the tuner's
  seeded initial tensors as biases, so round 1 sends every client LoRA's initialization (B = 0:
  the pretrained backbone unchanged) and personalization grows from there; the trunk and the
  descriptors start at PyTorch's defaults under the run seed.
* **Client's training**: the run's optimizer and local schedule (``local-epochs``/
  ``local-steps``, ``lr``; pFedSeq: SGD, 1 epoch, batch 32, lr 0.005) on the generated tensors
  and the local head; the authors' inner SGD (momentum 0.9, 50 steps) is the common keys'
  business. Their per-step clipping of the client's gradient at norm 50 is not applied.
* **Privacy.** The server needs every client's own update to train the hypernetwork: no
  SecAgg+ (it reveals only a sum) and no central DP (it noises only the average). Local DP
  works: each client's clipped, noised update is what the hypernetwork reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import Capabilities, MethodSpec, Split
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, RunConfig, setting

HEADS: tuple[str, ...] = ("local", "generated")


@dataclass(frozen=True)
class PFedHNSettings(MethodSettings):
    """pFedHN's keys: field ``lr`` is run-config key ``pfedhn-lr``, ``embedding_dim`` is
    ``pfedhn-embedding-dim``."""

    prefix: ClassVar[str] = "pfedhn"

    lr: float = setting(
        0.001,
        positive=True,
        doc=(
            "Adam learning rate of the hypernetwork and the client descriptors, one step a "
            "round (> 0; pFedSeq's 0.001 of {0.0001, 0.0005, 0.001, 0.005, 0.01})"
        ),
    )
    embedding_dim: int = setting(
        0,
        non_negative=True,
        doc="size of each client's descriptor v_i; `0`: the authors' int(1 + N / 4) for N clients",
    )
    hidden: int = setting(
        100, positive=True, doc="width of the hypernetwork's MLP (> 0; pFedSeq's 100)"
    )
    layers: int = setting(
        4,
        positive=True,
        doc="Linear layers of the MLP from descriptor to client embedding (> 0; pFedSeq's 4)",
    )
    clip: float = setting(
        50.0,
        non_negative=True,
        doc="the server gradient's global L2 norm is clipped to this (the authors' 50); `0`: none",
    )
    head: str = setting(
        "local",
        choices=HEADS,
        doc=(
            "`local`: the hypernetwork generates the adapter, each client keeps its own head "
            "(pFedHN-PC); `generated`: it generates the adapter and the head (plain pFedHN)"
        ),
    )


def generated_split(config: RunConfig) -> Split:
    """The adapter travels (and the head, when generated: ``pfedhn-head``); the rest stays."""
    if config.settings_of(PFedHNSettings).head == "generated":
        return Split(shared=("adapter", "head"), local=())
    return Split(shared=("adapter",), local=("head",))


# Tuned besides the common training keys (fedfm_flower.study.search): the hypernetwork's Adam step
# over the ends of pFedSeq's grid {0.0001, 0.0005, 0.001, 0.005, 0.01} (its Appendix B).
SEARCH = {"pfedhn-lr": LogUniform(1e-4, 1e-2)}

CAPABILITIES = Capabilities(
    central_dp="its hypernetwork is trained on each client's update, not only their average",
    local_dp=None,  # each client's noised update is all the hypernetwork reads of it
    secagg="its hypernetwork is trained on each client's update, which needs more than their "
    "sum (SecAgg+ reveals only that sum)",
)

SPECS = (
    MethodSpec(
        "pfedhn",
        strategy="strategies.pfedhn:PFedHNStrategy",
        client="client_apps.updates:UpdateClient",
        summary="a server hypernetwork generates each client's LoRA adapter from a learnable "
        "client descriptor, trained with the clients' updates as gradient proxies (Shamsian "
        "et al. 2021)",
        settings=PFedHNSettings,
        split=generated_split,
        search=SEARCH,
        capabilities=CAPABILITIES,
    ),
)
