"""FedAvg with local fine-tuning before each evaluation (the papers' FedLoRA "+ post-train").

``fedavg-ft-prox-mu`` > 0 adds FedProx's proximal term ``mu/2 ||w - w^t||^2`` to the federated
local training (not to the fine-tuning): FedDPA's Table 8 row "FedLoRA" under FedProx (its B.1:
FedProx, then local fine-tuning), the variant ``fedavg-ft:fedprox``. 0, the default, is FedAvg's
local step, as FedDPA's own ``feddpa-prox-mu``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, Split
from fedfm_flower.methods.settings import MethodSettings, setting


@dataclass(frozen=True)
class FedAvgFTSettings(MethodSettings):
    """FedAvg-FT's key: field ``prox_mu`` is run-config key ``fedavg-ft-prox-mu``."""

    prefix: ClassVar[str] = "fedavg-ft"

    # FedProx's mu in the federated local training (FedDPA's Table 8); 0 is FedAvg's step.
    prox_mu: float = setting(
        0.0,
        non_negative=True,
        doc=(
            "FedProx's mu in the federated local training, not in the fine-tuning (FedDPA's "
            "Table 8: FedProx, then local fine-tuning); 0 is plain FedAvg"
        ),
    )


SPECS = (
    MethodSpec(
        "fedavg-ft",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.fedavg_ft:FedAvgFineTuneClient",
        summary="FedAvg, then local fine-tuning of a copy before each evaluation",
        settings=FedAvgFTSettings,
        split=Split(shared=None, local=()),
        capabilities=AVERAGE_ONLY,
    ),
)
