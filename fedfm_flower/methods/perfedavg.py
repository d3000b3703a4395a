"""Per-FedAvg's run-config keys (``perfedavg-*``): the inner and outer step sizes.

Light (no torch): the config reads it through the method registry in every process, the
ClientApp's included. The client half is ``client_apps.perfedavg``. Defaults follow the FedPerfix
authors' code (github.com/imguangyu/FedPerfix, ``system/``), which uses the run's learning rate
for both steps (its saved Per-FedAvg setting sets that rate to 0.001, ``system/main.py`` line 76).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, ResourceProfile
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, setting


@dataclass(frozen=True)
class PerFedAvgSettings(MethodSettings):
    """Per-FedAvg's keys: field ``beta`` is run-config key ``perfedavg-beta``."""

    prefix: ClassVar[str] = "perfedavg"

    # Inner (adaptation) step; 0: the run's lr, as clientperavg.py (line 18: the optimizer of
    # the first step and of the step before evaluation has ``lr=self.learning_rate``).
    alpha: float = setting(
        0.0,
        non_negative=True,
        doc=(
            "Per-FedAvg's inner (adaptation) step size; `0` means the run's `lr` (the authors' "
            "code)"
        ),
    )
    # Outer (meta) step; 0: the run's lr, as clientperavg.py (line 15: ``self.beta =
    # self.learning_rate``; ``args.beta`` is commented out on line 14).
    beta: float = setting(
        0.0,
        non_negative=True,
        doc="Per-FedAvg's outer (meta) step size; `0` means the run's `lr` (the authors' code)",
    )

    def steps(self, lr: float) -> tuple[float, float]:
        """(alpha, beta), each the run's ``lr`` where it is 0."""
        return self.alpha or lr, self.beta or lr


# The meta-model w travels; a step takes two forward-backward passes (at w, then at temp).
_TWO_PASSES = ResourceProfile(passes=2)

# Tuned besides the common training keys (fedfm_flower.study.search): the inner and outer steps
# themselves, over absolute ranges. They are plain SGD without momentum whatever the setup's
# optimizer, so a range relative to the setup's lr misses where they train (multitask-cpu's
# AdamW lr 3e-4: 4 trials of lr 6e-5..1.9e-3 all left Per-FedAvg at validation 28-34; on
# glyphs-whole-vit it chose 0.044). Set, they make the run's lr irrelevant to its steps. The
# outer step reaches 0.3 (multitask-cpu chose 0.099 of 0.001-0.1).
SEARCH = {"perfedavg-alpha": LogUniform(1e-3, 0.1), "perfedavg-beta": LogUniform(1e-3, 0.3)}

SPECS = (
    MethodSpec(
        "per-fedavg",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.perfedavg:PerFedAvgClient",
        summary="the whole ViT trains; first-order MAML steps, FedAvg of the meta-model, one "
        "adaptation step before evaluation (Fallah et al. 2020; FedPerfix Table 2)",
        settings=PerFedAvgSettings,
        tuner="none",
        trains_backbone=True,
        profile=_TWO_PASSES,
        search=SEARCH,
        capabilities=AVERAGE_ONLY,
    ),
    MethodSpec(
        "per-fedavg-lora",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.perfedavg:PerFedAvgClient",
        summary="Per-FedAvg on the run's trainable parameters (LoRA + head on a frozen ViT, as "
        "pFedSeq's Tables 1 and 4 run every baseline); the backbone stays frozen",
        settings=PerFedAvgSettings,
        profile=_TWO_PASSES,
        search=SEARCH,
        capabilities=AVERAGE_ONLY,
    ),
    MethodSpec(
        "per-fedavg-ft",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.perfedavg:PerFedAvgFineTuneClient",
        summary="Per-FedAvg, then local fine-tuning of a copy before each evaluation (TAP's "
        "Per-FedAvg + Post-train)",
        settings=PerFedAvgSettings,
        tuner="none",
        trains_backbone=True,
        profile=_TWO_PASSES,
        search=SEARCH,
        capabilities=AVERAGE_ONLY,
    ),
)
