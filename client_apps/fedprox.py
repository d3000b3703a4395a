"""FedProx's client: FedAvg's local training with the proximal term towards the received model.

Every batch's loss gets ``fedprox-mu``/2 times the squared distance of the shared parameters
from the global tensors received this round (``fedfm_flower.tasks.training.proximal_term``), so the
gradient of the shared parameters gains ``mu (w - w_global)``. The term is applied at every
``mu``, 0 included: it adds exact zeros, so ``mu = 0`` trains as FedAvg bit for bit
(``tests/test_fedprox.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from client_apps.base import ClientRuntime
from client_apps.split import SplitClient
from fedfm_flower.methods.fedprox import FedProxSettings
from fedfm_flower.models import TunedModel
from fedfm_flower.tasks.training import proximal_term


class FedProxClient(SplitClient):
    """FedAvg's client with the proximal term towards the received global tensors."""

    def training_options(
        self,
        runtime: ClientRuntime,
        model: TunedModel,
        shared: list[str],
        received: dict[str, torch.Tensor],
    ) -> dict[str, Any]:
        """The proximal penalty on the shared parameters, added to every batch's loss."""
        return proximal_options(
            model, shared, received, runtime.config.settings_of(FedProxSettings).mu
        )


def proximal_options(
    model: TunedModel, shared: list[str], received: dict[str, torch.Tensor], mu: float
) -> dict[str, Any]:
    """Training options adding FedProx's mu/2 ||w - w_received||^2 on the shared parameters."""
    return {"penalty": proximal_term(model.parameters_named(shared), received, mu)}
