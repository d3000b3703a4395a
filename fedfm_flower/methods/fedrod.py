"""FedRoD (Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022), its linear form (Fed-RoD linear): a baseline of pFedPG's Tables 1-3.

Light (no torch): the config reads it through the method registry in every process, the
ClientApp's included. The client half is ``client_apps.fedrod``.

The model is a body ``f`` (the run's shared trainable parameters: LoRA, prompts, ... on the
frozen ViT, or the whole ViT with ``train-backbone = true``), a generic head ``h_G`` (the model's
``head`` group) and a personal head ``h_P`` of the same shape, kept by each client. Per batch
``(x, y)`` of client m, with ``z = f(x)`` and ``n_m`` the counts of the client's training
labels per class:

* generic loss, Balanced Softmax (BSM): ``CE(h_G(z) + log n_m, y)``; its gradient trains ``f``
  and ``h_G``;
* personal loss: ``CE(sg[h_G(z)] + h_P(sg[z]), y)`` (``sg``: stop-gradient); its gradient trains
  ``h_P`` only, which learns the residual on top of the generic predictor.

The server averages ``f`` and ``h_G`` (FedAvg, weighted by examples); ``h_P`` never leaves its
client (client state). The personalized prediction, whose accuracy is the run's ``accuracy``,
is ``h_G(z) + h_P(z)``; the generic one, ``h_G(z)``, is reported as ``generic-accuracy``.

Sources: the paper is not among ``../shared/papers`` and could not be read offline; the rule
above is its Sec. 4 as issue 78 summarises it, and every detail below was checked against the
public code: PFLlib (TsingZ0/PFLlib, ``system/flcore/clients/clientrod.py``), fluke
(makgyver/fluke, ``fluke/algorithms/fedrod.py``) and FL-bench (KarhouTam/FL-bench,
``src/client/fedrod.py``). pFedPG does not say whose code its baselines ran; its full-model
ones (Per-FedAvg, FedRep, FedBABU, FedRoD) are all PFLlib's. Deliberate choices:

* **Stop-gradient on both inputs of the personal loss** (PFLlib and fluke: ``rep.detach()``
  and ``out_g.detach()``): the body and the generic head get the BSM gradient only, so the
  averaged model is trained with the same class-balanced objective on every client, which is
  the paper's point. FL-bench differs (``h_P`` on the undetached ``z``, its loss on ``h_P(z)``
  alone, one summed backward, and ``h_P(z)`` alone as the personalized prediction); not
  followed.
* **One forward per batch**: both losses use the same ``z`` and ``h_G(z)``, computed before
  this batch's step (PFLlib and fluke step the body first, then ``h_P`` on the pre-step
  features). The two losses touch disjoint parameters, so one optimizer over all of them
  (the run's ``optimizer``, ``lr``, ``momentum``, ``weight-decay``) steps exactly as two
  optimizers with the same settings would (PFLlib: plain SGD at the run's lr for both); no
  key of its own for ``h_P``'s lr or schedule.
* **Classes absent from a client** have ``log n = -inf`` (PFLlib's ``spc.log()``): they drop
  out of the softmax's normaliser, the exact Balanced Softmax of a zero prior, and get no
  gradient from the generic loss.
* **Initialisation of** ``h_P`` (``fedrod-personal-init``): ``initial`` (default) starts it at
  the head's seeded initial values, the same on every client, as all three codes do (a copy of
  the initial generic head); ``zeros`` starts it at 0, so the personalized prediction equals
  the generic one until the client first trains.
* The paper's hypernetwork form (Fed-RoD hyper) and FL-bench's ``gamma`` exponent on the counts
  are not modelled.

It needs class logits and a class prior, so it serves image classification only
(``modalities``): a run on the instruction LM or TAP's multi-task model is refused at start
with the key ``method``. pFedPG's rows train the whole ViT-B/16 (8.58e7 parameters): run with
``tuner = none`` and ``train-backbone = true`` (as ``configs/setups/glyphs-whole-vit.toml``); by
default the body is the run's tuner (LoRA), as FedRep's here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, ResourceProfile, Split
from fedfm_flower.methods.settings import MethodSettings, setting

PERSONAL_INITS: tuple[str, ...] = ("initial", "zeros")


@dataclass(frozen=True)
class FedRoDSettings(MethodSettings):
    """FedRoD's key: field ``personal_init`` is run-config key ``fedrod-personal-init``."""

    prefix: ClassVar[str] = "fedrod"

    personal_init: str = setting(
        "initial",
        choices=PERSONAL_INITS,
        doc=(
            "FedRoD's personal head at a client's first round: `initial` (the head's seeded "
            "initial values, as PFLlib's, fluke's and FL-bench's FedRoD) or `zeros` (the "
            "personalized prediction starts equal to the generic one)"
        ),
    )


# Tuned besides the common training keys (fedfm_flower.study.search): nothing. Fed-RoD (linear) has
# no continuous hyper-parameter of its own (the personal head shares the run's optimizer).
SEARCH: dict = {}

SPECS = (
    MethodSpec(
        "fedrod",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.fedrod:FedRoDClient",
        summary="body and generic head averaged, trained with the balanced softmax; a personal "
        "head on the detached features learns the residual, predicts h_G + h_P (Chen & Chao "
        "2022; pFedPG Tables 1-3)",
        settings=FedRoDSettings,
        modalities=("image",),  # class logits and a class prior: classification only
        split=Split(shared=None, local=()),
        # h_P: a second head beside the model's (its one matmul per sample is not counted).
        profile=ResourceProfile(copied_groups=("head",)),
        search=SEARCH,
        capabilities=AVERAGE_ONLY,
    ),
)
