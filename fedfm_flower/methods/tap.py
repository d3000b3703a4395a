"""TAP's run-config keys (``tap-*``): replacement rule, loss scale and margins, distillation
weights, temperature, P, and the aggregation weights.

Light (no torch): the config reads it through the method registry in every process, the
ClientApp's included. Defaults are the paper's FLAVA column (Tables 21-22). A pair's *type* is
its kind with its input modality for classification: ``image-classification``,
``text-classification``, ``image-generation`` and ``text-generation`` (VQA answers in text, so
it is a text-generation pair, as in the paper's Table 22).

Choices (``client_apps/tap.py`` and ``strategies/tap.py`` say what each does):

- ``tap-replacement``: ``paper`` (default) copies every component that serves a pair with
  R = 1 (eq. 4 as written; the authors' ``replace_components``), ``all-pairs`` only those whose
  users among the client's pairs all have R = 1.
- ``tap-history``: the scale of h^(l) and h^(p). ``share-weighted`` (default) is the authors'
  code: per batch the pair's loss times its share of the batch, n_o / B, averaged over all the
  round's batches. ``pair-mean`` is the plain mean of the pair's per-example losses (the
  paper's words, "the average local training loss ... for each task"). The margins of Table 22
  were chosen on the authors' runs, so they belong to the share-weighted scale; on the
  pair-mean scale the same margin is a smaller bar (by the factor n_o / B).
- ``tap-aggregation``: ``data-size`` (default, eq. 1: each owner weighted by |D_i|, as the
  authors' code does) or ``uniform`` (each of a component's K_r owners by 1 / K_r, the form of
  the convergence proof, App. B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import Capabilities, MethodSpec, ResourceProfile
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, setting

REPLACEMENTS: tuple[str, ...] = ("paper", "all-pairs")
HISTORIES: tuple[str, ...] = ("share-weighted", "pair-mean")
AGGREGATIONS: tuple[str, ...] = ("data-size", "uniform")

PAIR_TYPES: tuple[str, ...] = (
    "image-classification",
    "text-classification",
    "image-generation",
    "text-generation",
)


@dataclass(frozen=True)
class TAPSettings(MethodSettings):
    """TAP's keys: field ``distill_steps`` is run-config key ``tap-distill-steps``."""

    prefix: ClassVar[str] = "tap"

    # Which of X's components eq. 4 replaces (module docstring).
    replacement: str = setting(
        "paper",
        choices=REPLACEMENTS,
        doc=(
            "which of X's components eq. 4 replaces: `paper`, every one serving a pair with R = 1 "
            "(eq. 4, the authors' code); `all-pairs`, only those whose users among the client's "
            "pairs all have R = 1 ([tap.md](methods/tap.md#tap))"
        ),
    )
    # The scale of the loss histories h that eq. 3 compares (module docstring).
    history: str = setting(
        "share-weighted",
        choices=HISTORIES,
        doc=(
            "the scale of the losses eq. 3 compares: `share-weighted`, per batch the pair's loss "
            "times n_o / B, averaged over the batches (the authors' code, the scale of Table 22's "
            "margins); `pair-mean`, the pair's plain mean loss"
        ),
    )
    # The weights of eq. 1's component-wise average (module docstring).
    aggregation: str = setting(
        "data-size",
        choices=AGGREGATIONS,
        doc=(
            "eq. 1's weights: `data-size`, each owner's training-set size; `uniform`, 1 / K_r per "
            "owner of a component (App. B)"
        ),
    )

    # m_{i,o} of eq. 3 by pair type (Table 22, FLAVA).
    margin_image_classification: float = setting(
        0.01,
        non_negative=True,
        doc=(
            "m of eq. 3: W~'s loss must beat X's by this much before X's parts are replaced (>= 0)"
        ),
    )
    margin_text_classification: float = setting(
        0.005, non_negative=True, doc="the same for text classification"
    )
    margin_image_generation: float = setting(
        0.005, non_negative=True, doc="the same for image generation"
    )
    margin_text_generation: float = setting(
        0.01, non_negative=True, doc="the same for text generation and VQA"
    )
    # beta_o of eq. 6 by pair type (Table 21: 2e-3, and 1 for text generation).
    distill_image_classification: float = setting(
        0.002,
        non_negative=True,
        doc="beta of eq. 6: weight of the distillation term of image classification pairs (>= 0)",
    )
    distill_text_classification: float = setting(
        0.002, non_negative=True, doc="the same for text classification"
    )
    distill_image_generation: float = setting(
        0.002, non_negative=True, doc="the same for image generation (MSE to the teacher's images)"
    )
    distill_text_generation: float = setting(
        1.0, non_negative=True, doc="the same for text generation and VQA"
    )
    # The KD temperature of eq. 5 (Table 21: 1).
    temperature: float = setting(1.0, positive=True, doc="the temperature of eq. 5 (> 0)")
    # P of sec. 3.3: mini-batch iterations of W~ and then of X after the last round (Table 21: 50).
    distill_steps: int = setting(
        50, positive=True, doc="P: iterations of W~, then of X, in the post-FL round (> 0)"
    )

    def margin(self, pair_type: str) -> float:
        """m of a pair type."""
        return getattr(self, f"margin_{pair_type.replace('-', '_')}")

    def distill_weight(self, pair_type: str) -> float:
        """beta of a pair type."""
        return getattr(self, f"distill_{pair_type.replace('-', '_')}")


# Tuned besides the common training keys (fedfm_flower.study.search): the margins of Table 22
# (0.005-0.01) with room each way: down to 3e-4 (multitask-cpu chose 0.001 of text generation's
# 0.001-0.05; the bound, 0, is out of a log range's reach).
SEARCH = {f"tap-margin-{pair}": LogUniform(3e-4, 0.05) for pair in PAIR_TYPES}

CAPABILITIES = Capabilities(
    central_dp="it averages each component over the clients that own it, so a component's "
    "average rests on a few clients and no single noise scale covers all",
    # Each client noises the components it sends before they leave, so the component-wise
    # averages are post-processing; the distillation round sends nothing up.
    local_dp=None,
    secagg="it sums each component over the clients that own it, not one sum over all "
    "clients (SecAgg+ reveals only that sum)",
)

SPECS = (
    MethodSpec(
        "tap",
        strategy="strategies.tap:TAPStrategy",
        client="client_apps.tap:TAPClient",
        summary="component-wise FedAvg of each client's modality-task components; a personal copy "
        "X refreshed by margin-based replacement, then distilled from the federated one after FL "
        "(TAP)",
        settings=TAPSettings,
        modalities=("multimodal",),
        # W~ (the client's components) travels; X, a second copy of them, stays.
        profile=ResourceProfile(copies=2),
        search=SEARCH,
        capabilities=CAPABILITIES,
    ),
)
