"""The client half of partial personalization by name (FedPerfix and the baselines it derives).

The personal parts (``fedperfix-personal``) live in client state; everything else trainable
comes from the server and goes back after joint local training, as in FedPerfix's Sec. 3.1:
the client plugs its ``v_i`` into the received ``u``, trains both, and sends ``u_i``.
"""

from __future__ import annotations

from client_apps.base import ClientRuntime
from client_apps.baselines import SplitClient
from fedfm_flower.models import TunedModel
from fedfm_flower.models.groups import split_names
from fedfm_flower.personal import PartialSettings


class PartialClient(SplitClient):
    """Shared parts from the server, personal parts (by name) in client state."""

    def split(self, runtime: ClientRuntime, model: TunedModel) -> tuple[list[str], list[str]]:
        """(shared, personal) parameter names of ``model``."""
        personal = runtime.config.settings_of(PartialSettings).personal_parts
        return split_names(model.parameter_groups(), None, personal, strict=True)
