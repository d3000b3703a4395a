"""FedDAT's run-config keys (``feddat-*``): the Dual-Adapter Teacher's mixture and the mutual KD.

Light (no torch): the config reads it through the method registry in every process, the
ClientApp's included. Defaults are those of the authors' released code
(github.com/HaokunChen245/FedDAT, ``src/``); the method is ``client_apps.feddat``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import Capabilities, MethodSpec, ResourceProfile
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, setting


@dataclass(frozen=True)
class FedDATSettings(MethodSettings):
    """FedDAT's keys: field ``local_weight`` is run-config key ``feddat-local-weight``."""

    prefix: ClassVar[str] = "feddat"

    # The client-specific adapter's weight in the DAT; the frozen global one gets 1 - it. The
    # official ``Adapter.forward`` (src/modeling/models/adapter.py) averages the two adapters'
    # outputs with fixed weights 0.5 (its learned gating is commented out).
    local_weight: float = setting(
        0.5,
        within=(0.0, 1.0),
        note="the DAT mixes its two adapters with weights w and 1 - w",
        doc=(
            "w: the client-specific adapter's weight in the Dual-Adapter Teacher, the frozen "
            "global adapter's being 1 - w, in [0, 1] (the official `Adapter.forward` averages the "
            "two: 0.5)"
        ),
    )
    # The KD temperature T; the KL term is scaled by T^2 (``kl_loss`` in
    # src/train/visionlanguage_tasks/task_trainer.py: temp=3, ``l_kl * temp**2``).
    temperature: float = setting(
        3.0,
        positive=True,
        doc=(
            "T of the mutual knowledge distillation; the KL term is scaled by T^2 (the official "
            "code: 3) (> 0)"
        ),
    )
    # The KD term's weight beside the task loss in each half of MKD: the official
    # ``TaskTrainer.train_step`` uses (task loss + KL) / 2, i.e. weight 1.
    distill_weight: float = setting(
        1.0,
        non_negative=True,
        doc=(
            "weight of the distillation term beside the task loss in each half of the mutual "
            "distillation (the official code: 1) (>= 0)"
        ),
    )


# The shared adapter A_s travels; A_c and the frozen global copy A_g stay on the client.
_THREE_ADAPTERS = ResourceProfile(copies=3)

# Tuned besides the common training keys (fedfm_flower.study.search): a decade each way of the
# mutual distillation's weight.
SEARCH = {"feddat-distill-weight": LogUniform(0.1, 10.0)}

CAPABILITIES = Capabilities(
    central_dp="not yet supported: FedDAT's server distils between adapters it keeps per round",
    local_dp="not yet supported: its server's distillation between the adapters it keeps is "
    "a phase the local mechanism does not cover",
    secagg="its server distils between the adapters it keeps, which needs more than the sum "
    "of the clients' shared tensors (SecAgg+ reveals only that sum)",
)

SPECS = (
    MethodSpec(
        "feddat",
        strategy="strategies.feddat:FedDATStrategy",
        client="client_apps.feddat:FedDATClient",
        summary="shared LoRA averaged component-wise (equal client weights); a Dual-Adapter "
        "Teacher (frozen received global + client-specific LoRA) and mutual KD (Chen et al. 2024)",
        settings=FedDATSettings,
        modalities=("multimodal",),
        profile=_THREE_ADAPTERS,
        search=SEARCH,
        capabilities=CAPABILITIES,
    ),
    MethodSpec(
        "feddat-ft",
        strategy="strategies.feddat:FedDATStrategy",
        client="client_apps.feddat:FedDATFineTuneClient",
        summary="FedDAT, then more of its local training (mutual KD) on a copy before each "
        "evaluation (TAP's FedDAT + Post-train)",
        settings=FedDATSettings,
        modalities=("multimodal",),
        profile=_THREE_ADAPTERS,
        search=SEARCH,
        capabilities=CAPABILITIES,
    ),
)
