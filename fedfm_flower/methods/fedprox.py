"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

Each client minimises its loss plus the proximal term ``mu/2 ||w - w^t||^2`` over the shared
parameters ``w`` (here every trainable tensor: adapter and head, or what the run trains), where
``w^t`` is the global model it received this round (``client_apps.fedprox``); the server is
FedAvg's, weighted by examples. ``mu = 0`` is FedAvg exactly. The paper's inexact local solvers
and its device sampling by data size are not modelled: clients run the configured local schedule
and are sampled uniformly, as for every method here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, Split
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, setting


@dataclass(frozen=True)
class FedProxSettings(MethodSettings):
    """FedProx's key: field ``mu`` is run-config key ``fedprox-mu``."""

    prefix: ClassVar[str] = "fedprox"

    # The proximal weight; the paper tunes it over {0.001, 0.01, 0.1, 0.5, 1} per dataset.
    mu: float = setting(
        0.01,
        non_negative=True,
        doc=(
            "FedProx's proximal weight mu on the distance to the received global parameters (>= "
            "0; the paper tunes it over {0.001, 0.01, 0.1, 0.5, 1} per dataset); 0 is plain "
            "FedAvg"
        ),
    )


# Tuned besides the common training keys (fedfm_flower.study.search): FedProx's grid of mu spans
# 0.001-1 (Li et al. 2020, Sec. 5).
SEARCH = {"fedprox-mu": LogUniform(1e-3, 1.0)}

SPECS = (
    MethodSpec(
        "fedprox",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.fedprox:FedProxClient",
        summary="FedAvg with a proximal term mu/2 ||w - w_global||^2 on the clients' loss "
        "(Li et al. 2020)",
        settings=FedProxSettings,
        split=Split(shared=None, local=()),
        search=SEARCH,
        capabilities=AVERAGE_ONLY,
    ),
)
