"""TAP's run-config keys (``tap-*``): replacement margins, distillation weights, temperature, P.

Light (no torch): the config reads it through the method registry in every process, the
ClientApp's included. Defaults are the paper's FLAVA column (Tables 21-22). A pair's *type* is
its kind with its input modality for classification: ``image-classification``,
``text-classification``, ``image-generation`` and ``text-generation`` (VQA answers in text, so
it is a text-generation pair, as in the paper's Table 22).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import MethodSpec, ResourceProfile
from fedfm_flower.settings import MethodSettings, setting

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

    # m_{i,o} of eq. 3 by pair type (Table 22, FLAVA).
    margin_image_classification: float = setting(0.01, non_negative=True)
    margin_text_classification: float = setting(0.005, non_negative=True)
    margin_image_generation: float = setting(0.005, non_negative=True)
    margin_text_generation: float = setting(0.01, non_negative=True)
    # beta_o of eq. 6 by pair type (Table 21: 2e-3, and 1 for text generation).
    distill_image_classification: float = setting(0.002, non_negative=True)
    distill_text_classification: float = setting(0.002, non_negative=True)
    distill_image_generation: float = setting(0.002, non_negative=True)
    distill_text_generation: float = setting(1.0, non_negative=True)
    # The KD temperature of eq. 5 (Table 21: 1).
    temperature: float = setting(1.0, positive=True)
    # P of sec. 3.3: mini-batch iterations of W~ and then of X after the last round (Table 21: 50).
    distill_steps: int = setting(50, positive=True)

    def margin(self, pair_type: str) -> float:
        """m of a pair type."""
        return getattr(self, f"margin_{pair_type.replace('-', '_')}")

    def distill_weight(self, pair_type: str) -> float:
        """beta of a pair type."""
        return getattr(self, f"distill_{pair_type.replace('-', '_')}")


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
    ),
)
