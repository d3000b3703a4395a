"""FedPerfix (Sun et al. 2023): partial personalization by name; which parts stay local.

``fedperfix-personal`` lists the parts of the model that never leave the client, comma-separated:
parameter-group names (``prefix``, ``head``, ``vit.attn``, ``vit.norm``, ``mlp-adapter``; a
parent such as ``vit`` selects all its children) or regular expressions over parameter names
(``blocks\\.11\\.``; a comma cannot appear in one). Every other trainable tensor is averaged
over the clients with FedAvg. An entry that selects nothing is an error when the run starts.
The paper's sensitivity study and the baselines it derives (FedBN, FedPer / Vanilla Attention,
...) are this method with other parts (``configs/fedperfix/``). Server: FedAvg of the rest,
weighted by examples (FedPerfix's eq. 2); client: joint training of both, as Sec. 3.1 (the client
plugs its ``v_i`` into the received ``u``, trains both, and sends ``u_i``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, Split
from fedfm_flower.methods.ranges import Uniform
from fedfm_flower.methods.settings import ConfigError, MethodSettings, RunConfig, setting


@dataclass(frozen=True)
class FedPerfixSettings(MethodSettings):
    """FedPerfix's keys: field ``personal`` is run-config key ``fedperfix-personal``."""

    prefix: ClassVar[str] = "fedperfix"

    # FedPerfix: the prefix adapters of every attention layer and the head (Sec. 3.5).
    personal: str = setting(
        "prefix,head",
        doc=(
            "the parts that stay on each client, comma-separated: group names (`prefix`, `head`, "
            "`vit.norm`, `vit` for every ViT part, ...) or regular expressions over parameter "
            "names (`blocks\\\\.11\\\\.`); everything else trainable is averaged. An entry that "
            "selects nothing is an error at start"
        ),
        example="head",
    )

    @property
    def personal_parts(self) -> tuple[str, ...]:
        """The entries of ``personal``, stripped, empty ones dropped."""
        return tuple(p.strip() for p in self.personal.split(",") if p.strip())

    def check(self) -> None:
        """Every entry is a group name or a regular expression."""

        for entry in self.personal_parts:
            try:
                re.compile(entry)
            except re.error as err:
                key = self.key_of("personal")
                raise ConfigError(key, self.personal, f"{entry!r}: {err}") from err


def personal_split(config: RunConfig) -> Split:
    """Everything but ``fedperfix-personal`` travels; each of its entries must select something."""
    personal = config.settings_of(FedPerfixSettings).personal_parts
    return Split(shared=None, local=personal, strict=True, key=FedPerfixSettings.key_of("personal"))


# Tuned besides the common training keys (fedfm_flower.study.search): s of eq. 5: the authors'
# argparse default 0.8 and preset 1.5 lie inside.
SEARCH = {"prefix-scale": Uniform(0.5, 2.0)}

SPECS = (
    MethodSpec(
        "fedperfix",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.split:SplitClient",
        summary="the whole ViT trains; FedAvg of all but the personal parts (default: prefix "
        "adapters in every attention layer + head) (Sun et al. 2023)",
        settings=FedPerfixSettings,
        tuner="perfix",
        trains_backbone=True,
        split=personal_split,
        search=SEARCH,
        capabilities=AVERAGE_ONLY,
    ),
)
