"""APFL's run-config keys (``apfl-*``): the initial mixing weight and its step size.

Light (no torch): the config reads it through the method registry in every process, the
ClientApp's included. The client half is ``client_apps.apfl``. Defaults follow the FedPerfix
authors' code (github.com/imguangyu/FedPerfix, ``system/``), the code of the paper's Table 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, ResourceProfile
from fedfm_flower.methods.ranges import Uniform
from fedfm_flower.methods.settings import MethodSettings, setting


@dataclass(frozen=True)
class APFLSettings(MethodSettings):
    """APFL's keys: field ``alpha_lr`` is run-config key ``apfl-alpha-lr``."""

    prefix: ClassVar[str] = "apfl"

    # Initial alpha of every client: FedPerfix's saved APFL setting (system/main.py, line 69,
    # ``args.alpha = 0.25``; the argparse default, line 334, is 1.0).
    alpha: float = setting(
        0.25,
        within=(0.0, 1.0),
        note="alpha mixes v and w",
        doc=(
            "APFL's initial mixing weight alpha of the personal model, in [0, 1] (the authors' "
            "FedPerfix setting; the APFL paper tunes it)"
        ),
    )
    # Step size of alpha; 0: the run's lr, as the authors' clientapfl.py (line 93:
    # ``alpha - learning_rate * grad_alpha``).
    alpha_lr: float = setting(
        0.0,
        non_negative=True,
        doc="step size of alpha's gradient step; `0` means the run's `lr` (the authors' code)",
    )

    def alpha_step(self, lr: float) -> float:
        """The step size of alpha: ``alpha-lr``, or the run's ``lr`` when it is 0."""
        return self.alpha_lr or lr


# Tuned besides the common training keys (fedfm_flower.study.search): the mixing weight's whole
# range (APFL, Deng et al. 2020), whose both ends are the weight's bounds.
SEARCH = {"apfl-alpha": Uniform(0.0, 1.0)}
SEARCH_LIMITS = {
    ("apfl-alpha", "bottom"): "a mixing weight: 0 evaluates the shared model w alone",
    ("apfl-alpha", "top"): "a mixing weight: 1 evaluates the personal model v alone",
}

SPECS = (
    MethodSpec(
        "apfl",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.apfl:APFLClient",
        summary="the whole ViT trains; FedAvg of w, personal v and adaptive alpha per client, "
        "evaluates alpha v + (1 - alpha) w (Deng et al. 2020; FedPerfix Table 2)",
        settings=APFLSettings,
        tuner="none",
        trains_backbone=True,
        # w travels; v (a second copy of every trainable tensor) and alpha stay on the client,
        # and a step takes two forward-backward passes (at w and at the mixture).
        profile=ResourceProfile(copies=2, passes=2, extra=1),
        search=SEARCH,
        search_limits=SEARCH_LIMITS,
        capabilities=AVERAGE_ONLY,
    ),
)
