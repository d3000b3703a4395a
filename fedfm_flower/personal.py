"""Partial personalization by name (FedPerfix's ``fedperfix-*`` keys): which parts stay local.

``fedperfix-personal`` lists the parts of the model that never leave the client, comma-separated:
parameter-group names (``prefix``, ``head``, ``vit.attn``, ``vit.norm``, ``mlp-adapter``; a
parent such as ``vit`` selects all its children) or regular expressions over parameter names
(``blocks\\.11\\.``; a comma cannot appear in one). Every other trainable tensor is averaged
over the clients with FedAvg. An entry that selects nothing is an error when the run starts.
Light (no torch): the ClientApp parses these keys in every message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.settings import ConfigError, MethodSettings, setting


@dataclass(frozen=True)
class PartialSettings(MethodSettings):
    """FedPerfix's keys: field ``personal`` is run-config key ``fedperfix-personal``."""

    prefix: ClassVar[str] = "fedperfix"

    # FedPerfix: the prefix adapters of every attention layer and the head (Sec. 3.5).
    personal: str = setting("prefix,head")

    @property
    def personal_parts(self) -> tuple[str, ...]:
        """The entries of ``personal``, stripped, empty ones dropped."""
        return tuple(p.strip() for p in self.personal.split(",") if p.strip())

    def check(self) -> None:
        """Every entry is a group name or a regular expression."""
        import re

        for entry in self.personal_parts:
            try:
                re.compile(entry)
            except re.error as err:
                key = self.key_of("personal")
                raise ConfigError(key, self.personal, f"{entry!r}: {err}") from err
