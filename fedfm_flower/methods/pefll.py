"""PeFLL (Scott, Zakerinia, Lampert, "PeFLL: Personalized Federated Learning by Learning to
Learn", ICLR 2024): an embedding network turns a client's data into a descriptor, a hypernetwork
turns the descriptor into the client's parameters; both are trained from the clients' updates.

The paper's round, for each sampled client i (its Figure 2 and training algorithm; the
authors' code, github.com/pefllauthors/PeFLL, runs all of it on one machine):

1. forward: the server sends the embedding network psi; the client computes its descriptor
   v_i = 1/|B| sum_{(x, y) in B} E(x, y; psi) on a batch B of its data and sends v_i; the server
   sends theta_i = h(v_i; phi) (here of the normalized descriptor: below);
2. the client trains theta_i for k local steps to theta_i~ and sends Delta_i = theta_i~ - theta_i;
3. backward: the server takes (d theta_i / d phi)^T (theta_i - theta_i~) for phi and sends the
   descriptor's gradient g_i = (d theta_i / d v_i)^T (theta_i - theta_i~); the client
   backpropagates it through E on B and sends (d v_i / d psi)^T g_i;
4. the server averages both gradients over the round's clients and steps phi and psi (Adam).

That is three message trips per client and round. **This implementation's schedule** keeps
Flower's one message per client per round, which everything here is built on (rounds, fused
evaluation, timeouts, the byte and release accounting, checkpoints, restarts); its own
exchanges would be invisible to all of them. Round t's message to client i carries psi^t, the
tensors theta_i^t = h(v_i; phi^t) generated from the descriptor v_i the client sent at its
previous participation t' (computed then with psi^t' on batch B^t'), and the Jacobian
d theta_i^t / d v_i of the hypernetwork at that point (a (d x |theta|) tensor: d = int(1 + N/4),
3 for pFedSeq's 10 clients). The client

* trains theta_i^t (with its local head) and computes Delta_i, as in pFedHN;
* computes the descriptor's gradient g_i = -(d theta_i / d v_i)^T Delta_i from the Jacobian, and
  backpropagates it through E at psi^t' on B^t' (both kept in its state from t'; B^t' is
  redrawn from that round's seed): (d v_i / d psi)|_{psi^t'}^T g_i, exactly the step-3 gradient
  the paper's client would have computed for this descriptor;
* computes its next descriptor v_i = E(B^t; psi^t) with the psi it just received;
* replies with Delta_i, the new v_i and the psi gradient.

The server steps phi with the pFedHN vector-Jacobian product of Delta_i at the v_i it used, and
psi with the clients' gradients, in one Adam step on the means over the round's clients (the
authors' ``avg_grads`` with their ``clients_per_step``), clipped jointly to norm 50 as theirs.
phi's mean is over every reporting client, psi's over the clients that sent a psi gradient: in
the paper every client of a step sends both, so each mean is over the clients that computed
that gradient; dividing psi's sum by every reporting client would shrink it by the share of
clients at their first participation (d below) and, under the joint clip, tilt the step
towards phi.

What differs from the paper: (a) theta_i^t comes from a descriptor computed with the embedding
network of the client's previous participation (psi^t', batch B^t') instead of psi^t, so the
personalization lags E by one participation; (b) the psi gradient of that descriptor is exact
but evaluated at psi^t' and applied to psi^t: a gradient delayed by one participation, as in
asynchronous SGD (with every client in every round, one round); (c) the Jacobian travels down
instead of g_i (d times theta's size) so that (b) needs no further trip; (d) at a client's first
participation the server has no descriptor: theta_i comes from the descriptor 0 (the mean
descriptor after the normalization below), that round gives no psi gradient, and the
hypernetwork still learns from Delta_i. Nothing else is approximated: with these inputs every
gradient is the paper's chain rule.

Hyper-parameters and the other choices:

* ``pefll-lr``: Adam's step of phi and psi together, 0.001 (pFedSeq's Appendix B: tuned over
  {0.0001, 0.0005, 0.001, 0.005, 0.01}, 0.001 on CIFAR-100; the authors' default is 0.0002).
* The hypernetwork is pFedHN's (``fedfm_flower.learners.hypernetwork``; pFedSeq: "similar to
  pFedHN"): ``pefll-hidden`` 100, ``pefll-layers`` 4 (the authors' ``hyper_nhid = 3``), output
  layers starting at the tuner's initial tensors. ``pefll-head``: what it generates, as
  ``pfedhn-head`` (default the LoRA adapter, each client keeping its head; see
  ``fedfm_flower.methods.pfedhn``).
* The embedding network (``fedfm_flower.learners.embedding_network``): pFedSeq's LeNet-style
  ConvNet on raw images, ``pefll-kernels`` 16 and 32 channels; images resized to the LeNet's
  32 x 32; the one-hot label as extra channels (``pefll-embed-labels``, the authors' ``embed_y``
  default). ``pefll-embedding-dim`` 0 is the authors' int(1 + N / 4).
* The descriptor batch: the first ``pefll-embed-batches`` batches (the authors' 1) of the
  client's training split in a seeded order of its own (batch size ``batch-size``); 0 means the
  whole split.
* Normalization: the authors rescale every descriptor by fixed scalars, (v - m) / s, where m
  and s are the mean and standard deviation of the first descriptor they ever computed. Here m
  and s are those of the first round's reported descriptors (all their entries), fixed from
  then on and checkpointed; the Jacobian sent is with respect to the raw v.
* ``pefll-clip``: the global norm of the joint (phi, psi) gradient is clipped to 50 (the
  authors'); 0: none.
* Client-state safety: the message names the round of the descriptor it was generated from; a
  client whose kept state is not that round's (lost state, a dropped reply) sends no psi
  gradient that round (``pefll.has-gradient`` = 0) instead of a wrong one.
* Privacy: the server needs each client's update, descriptor and gradient: no SecAgg+, no
  central DP; no local DP either (its clip and noise are defined for model updates, and a
  reply here also holds a descriptor and a gradient of the embedding network).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import Capabilities, MethodSpec, ResourceProfile, Split, descriptor_size
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, RunConfig, setting

HEADS: tuple[str, ...] = ("local", "generated")  # pfedhn-head's (a method imports no method)


@dataclass(frozen=True)
class PeFLLSettings(MethodSettings):
    """PeFLL's keys: field ``lr`` is run-config key ``pefll-lr``, ``embed_batches`` is
    ``pefll-embed-batches``."""

    prefix: ClassVar[str] = "pefll"

    lr: float = setting(
        0.001,
        positive=True,
        doc=(
            "Adam learning rate of the hypernetwork and the embedding network, one step a round "
            "(> 0; pFedSeq's 0.001 of {0.0001, 0.0005, 0.001, 0.005, 0.01})"
        ),
    )
    embedding_dim: int = setting(
        0,
        non_negative=True,
        doc="size of the client descriptor v_i; `0`: the authors' int(1 + N / 4) for N clients",
    )
    hidden: int = setting(
        100, positive=True, doc="width of the hypernetwork's MLP (> 0; pFedSeq's 100)"
    )
    layers: int = setting(
        4, positive=True, doc="Linear layers of the hypernetwork's MLP (> 0; the authors' 4)"
    )
    kernels: int = setting(
        16,
        positive=True,
        doc="channels of the embedding ConvNet's first conv, twice that in the second (> 0)",
    )
    embed_labels: bool = setting(
        True,
        doc="feed the one-hot label to the embedding network as extra channels (the authors')",
    )
    embed_batches: int = setting(
        1,
        non_negative=True,
        doc="batches of the client's data its descriptor averages over; `0`: the whole split",
    )
    clip: float = setting(
        50.0,
        non_negative=True,
        doc="the joint gradient's global L2 norm is clipped to this (the authors' 50); `0`: none",
    )
    head: str = setting(
        "local",
        choices=HEADS,
        doc=(
            "`local`: the hypernetwork generates the adapter, each client keeps its own head; "
            "`generated`: it generates the adapter and the head"
        ),
    )


def generated_split(config: RunConfig) -> Split:
    """The adapter travels (and the head, when generated: ``pefll-head``); the rest stays."""
    if config.settings_of(PeFLLSettings).head == "generated":
        return Split(shared=("adapter", "head"), local=())
    return Split(shared=("adapter",), local=("head",))


IMAGE_CHANNELS = 3  # the embedding network sees the ViT's RGB input
MESSAGE_PREFIX = "pefll."  # the method's message entries beside the generated tensors


def embedding_parameters(settings: PeFLLSettings, classes: int, dim: int) -> int:
    """Parameters of ``learners.embedding_network.EmbeddingNetwork`` (its LeNet layout: two 5x5
    convs of k and 2k channels, 5x5 maps, then 120, 84 and dim units), counted without torch."""
    k = settings.kernels
    channels = IMAGE_CHANNELS + (classes if settings.embed_labels else 0)
    layers = ((channels * 25, k), (k * 25, 2 * k), (2 * k * 25, 120), (120, 84), (84, dim))
    return sum((inputs + 1) * outputs for inputs, outputs in layers)


def pefll_traffic(config: RunConfig, shared: int, classes: int) -> tuple[int, int]:
    """A round of a client that took part before: up Delta_i, v_i, the psi gradient and its
    flag; down theta_i, psi, the descriptor's round and d theta_i / d v_i (d x theta)."""
    settings = config.settings_of(PeFLLSettings)
    dim = descriptor_size(settings.embedding_dim, config.num_clients)
    psi = embedding_parameters(settings, classes, dim)
    return shared + dim + psi + 1, shared + psi + 1 + dim * shared


# Tuned besides the common training keys (fedfm_flower.study.search): the Adam step of both networks
# over the ends of pFedSeq's grid {0.0001, 0.0005, 0.001, 0.005, 0.01} (its Appendix B).
SEARCH = {"pefll-lr": LogUniform(1e-4, 1e-2)}

_EACH = "its networks are trained on each client's own update, descriptor and gradient"
CAPABILITIES = Capabilities(
    central_dp=f"{_EACH}, not on their average",
    local_dp=f"{_EACH}; local DP's clip and noise are defined for model updates alone",
    secagg=f"{_EACH}, which needs more than their sum (SecAgg+ reveals only that sum)",
)

SPECS = (
    MethodSpec(
        "pefll",
        strategy="strategies.pefll:PeFLLStrategy",
        client="client_apps.pefll:PeFLLClient",
        summary="an embedding network turns each client's data into a descriptor, a server "
        "hypernetwork turns it into the client's LoRA adapter; both trained from the clients' "
        "updates (Scott et al. 2024)",
        settings=PeFLLSettings,
        modalities=("image",),  # the embedding network is a ConvNet on images and labels
        split=generated_split,
        profile=ResourceProfile(traffic=pefll_traffic),
        message_prefix=MESSAGE_PREFIX,
        search=SEARCH,
        capabilities=CAPABILITIES,
    ),
)
