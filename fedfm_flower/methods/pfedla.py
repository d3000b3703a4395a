"""pFedLA (Ma, Zhang, Guo, Xu, "Layer-wised Model Aggregation for Personalized Federated
Learning", CVPR 2022): the server keeps every client's latest model and, per client, a
hypernetwork that outputs layer-wise weights for aggregating all clients' models into that
client's personalized model.

The rule, round t, for each selected client i (N clients, layers l = 1..L):

    alpha_i = HN_i(v_i; phi_i),        alpha_i^l in R^N, alpha_ij^l >= 0, sum_j alpha_ij^l = 1
    theta~_i^l = sum_j alpha_ij^l theta_j^l                      (the model sent to client i)

client i trains theta~_i locally and returns Delta theta_i = (trained) - theta~_i; the server
then takes one step on client i's hypernetwork (embedding v_i and weights phi_i) by the chain
rule through theta~_i with -Delta theta_i standing for the gradient of client i's loss at
theta~_i,

    grad_(v_i, phi_i) = (d alpha_i / d (v_i, phi_i))^T (d theta~_i / d alpha_i)^T (-Delta theta_i),

and stores client i's latest model theta_i <- theta~_i + Delta theta_i. The server half is
``fedfm_flower.learners.pfedla`` (on tensors) and ``strategies.pfedla`` (Flower); the client is
plain local training that sends its update (``client_apps.updates.UpdateClient``).

Hyper-parameters and the choices made here:

* What is aggregated: the run's trainable tensors (pFedSeq compares every baseline on LoRA +
  head). By default every one of them, the head included (``pfedla-head = "mixed"``): pFedLA
  personalizes every layer through its learnt weights (its CNNs aggregate every layer, as the
  public implementations, KarhouTam/pFedLA and FL-bench, do), and a client's hypernetwork can
  learn to keep its own head (alpha_ii^head -> 1).
  ``pfedla-head = "local"`` keeps the head on the client (trained jointly, never sent, as
  pFedSeq's, pFedPG's and pFedHN's default splits here) and mixes the adapters only, pFedSeq's
  Appendix B reading ("layer-wise aggregation weights for combining client-specific
  adapters").
* What a layer is (``pfedla-layers``). ``block`` (default): the tensors of one transformer
  block form one layer (name up to its first ``.<index>.``: ``backbone.blocks.3``,
  ``layers.11``; ``fedfm_flower.learners.layout.layer_key``): on the ViT the LoRA factors A and B
  of every targeted module of block k share one alpha_i^k; a tensor without a block index is in
  the layer of its parameter group (the head's weight and bias form layer ``head``). This is
  the paper's granularity (a CNN layer, its weight and bias together; KarhouTam/pFedLA groups
  by top-level module). ``tensor``: one weight vector per trainable tensor (FL-bench's
  granularity). Layers are ordered by their first tensor in model order.
* The hypernetwork of client i: embedding v_i (``pfedla-embedding-dim``, 100), an MLP of three
  Linear + ReLU layers of width ``pfedla-hidden`` (100: pFedSeq's Appendix B, "similar to
  pFedHN's, hidden size 100"; three as both public implementations), and one last FC layer
  with L x N outputs, the layer-wise weights (the implementations' one FC per layer is the same
  map, row blocks of this one). Normalisation, as both implementations: ReLU, then each layer's
  N values divided by their sum, so the weights are non-negative and sum to 1; a layer whose
  N values are all 0 falls back to client i's own model (weight 1 on itself), as there.
  Initialisation (seeded by ``seed``): v_i ~ N(0, 1), the MLP PyTorch's default, the last FC's
  weights U(0, 1) and biases 0 (both implementations: with the default init whole rows come
  out negative, i.e. all-zero weights), so every client starts with nearly uniform weights.
  Every client's stored model starts at the model's seeded initial tensors, so round 1 sends
  every client the same model.
* The optimiser: Adam at ``pfedla-lr`` = 0.001, one step per round on each reporting client's
  hypernetwork (pFedSeq's Appendix B: Adam, lr tuned over {0.0001, 0.0005, 0.001, 0.005, 0.01},
  0.001 on three of its four datasets; the public implementations use plain SGD at 5e-3). One
  Adam holds every client's hypernetwork; a client that does not report has no gradient and
  Adam skips it (as N separate Adams would).
* The sign: the vector-Jacobian product takes -Delta theta_i = theta~_i - (trained), the
  descent direction of client i's loss, as pFedHN's official code (its ``delta_theta`` is sent
  minus trained) and pFedPG here; with Delta theta_i itself and a descent step (the public
  pFedLA implementations' code as written) the step moves theta~_i away from the trained model.
* A round is synchronous: every selected client is sent theta~_i from the same stored models;
  the server computes every reporting client's hypernetwork gradient through the theta~_i it
  was sent before it stores any new model (the public implementations train clients one after
  another, each seeing the models the earlier ones stored).
* Stored models: theta_i <- theta~_i + Delta theta_i, the model client i trained (KarhouTam's
  code replaces theta_i by theta~_i and adds the update); a client that did not report keeps
  its theta_i.
* Evaluation: client i evaluates theta~_i from its current hypernetwork and the stored models
  (the next round's payload), as the implementations' test.
* Not here: HeurpFedLA (the paper's variant that keeps the top-K self-weighted layers local).
* Privacy: each hypernetwork is trained on its client's own update, so no SecAgg+ or central
  DP (``CAPABILITIES``); local DP fits (a noised update is all the server reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import Capabilities, MethodSpec, Split
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, RunConfig, setting

LAYERINGS: tuple[str, ...] = ("block", "tensor")  # learners.pfedla.layer_groups
HEADS: tuple[str, ...] = ("mixed", "local")


@dataclass(frozen=True)
class PFedLASettings(MethodSettings):
    """pFedLA's server hyperparameters: field ``embedding_dim`` is run-config key
    ``pfedla-embedding-dim``."""

    prefix: ClassVar[str] = "pfedla"

    lr: float = setting(
        0.001,
        positive=True,
        doc=(
            "Adam learning rate of the clients' hypernetworks, one step per round on each "
            "reporting client's hypernetwork (> 0; pFedSeq sets 0.001 of {0.0001, ..., 0.01})"
        ),
    )
    embedding_dim: int = setting(
        100, positive=True, doc="width of each client's hypernetwork embedding v_i (> 0)"
    )
    hidden: int = setting(
        100,
        positive=True,
        doc="width of the three hidden layers of each client's hypernetwork (> 0; pFedSeq's 100)",
    )
    layers: str = setting(
        "block",
        choices=LAYERINGS,
        doc=(
            "what one aggregation weight vector alpha_i^l covers: `block` (the tensors of one "
            "transformer block; the head's tensors together) or `tensor` (every trainable "
            "tensor on its own, FL-bench's granularity)"
        ),
    )
    head: str = setting(
        "mixed",
        choices=HEADS,
        doc=(
            "`mixed` (default): the head is one more layer the hypernetworks mix; `local`: the "
            "head stays on the client (trained jointly, never sent) and only the adapters are "
            "mixed"
        ),
    )


def pfedla_split(config: RunConfig) -> Split:
    """Every trainable tensor travels, or all but the head with ``pfedla-head = "local"``."""
    if config.settings_of(PFedLASettings).head == "local":
        return Split(shared=None, local=("head",))
    return Split(shared=None, local=())


# Tuned besides the common training keys (fedfm_flower.study.search): the hypernetworks' Adam step
# over the ends of pFedSeq's grid {0.0001, 0.0005, 0.001, 0.005, 0.01} (its Appendix B).
SEARCH = {"pfedla-lr": LogUniform(1e-4, 1e-2)}

CAPABILITIES = Capabilities(
    central_dp="each client's hypernetwork is trained on that client's own update, not only "
    "the average of the updates",
    local_dp=None,  # each client's noised update is all its hypernetwork reads
    secagg="each client's hypernetwork is trained on that client's own update, which needs "
    "more than their sum (SecAgg+ reveals only that sum)",
)

SPECS = (
    MethodSpec(
        "pfedla",
        strategy="strategies.pfedla:PFedLAStrategy",
        client="client_apps.updates:UpdateClient",
        summary="per-client hypernetworks give layer-wise weights that mix all clients' latest "
        "models into each client's model (Ma et al. 2022)",
        settings=PFedLASettings,
        # Clients send the update of what they received; the head too unless pfedla-head = local.
        split=pfedla_split,
        search=SEARCH,
        capabilities=CAPABILITIES,
    ),
)
