"""The strategy's count of its DP releases, chosen when the strategy is built from ``dp``.

``ReleaseAccounting`` (``dp = none``) counts nothing. ``LocalReleases`` (``dp = local``) counts one
release per federated round when the round's training messages are built (each sampled client
answers with at most one noised update) and adds the round's release metrics (epsilon so far,
the noise std sigma C of each client's release, the sensitivity 2C) to the server metrics of
every round, with a valid reply or not (the clients released all the same). ``CentralReleases``
(``dp = central``) counts the release that DP-FedAvg's noised average makes
(``strategies.parts.averaging.DPFedAvg``, which returns its metrics); that average is released
even in a round whose every reply was rejected (``releases_without_replies``): the mean of no
update plus the noise, DP-FedAvg's fixed denominator, so an unchanged model never tells that
every reply failed. Both keep a ``ReleaseLedger`` (``fedfm_flower.privacy.ledger``),
checkpointed under ``privacy`` in the strategy state's metadata and restored from it; Opacus,
which reports the epsilon, and a target epsilon's noise multiplier are checked when they are
built.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.privacy import accountant
from fedfm_flower.privacy.ledger import ReleaseLedger


class ReleaseAccounting:
    """The accounting of a strategy's releases; as it is, that of no DP: nothing is released,
    nothing counted or checkpointed."""

    ledger: ReleaseLedger | None = None
    releases_without_replies: ClassVar[bool] = False  # a round with no valid reply still releases

    def __init__(self, config: ExperimentConfig) -> None:
        self.config = config

    def dispatched(self, server_round: int, phase: str) -> None:
        """A round's training messages (of ``phase``) are built."""

    def round_metrics(self) -> dict[str, float]:
        """Server metrics of a round's releases, added after its aggregation (none)."""
        return {}

    def state_meta(self) -> dict[str, Any]:
        """What the strategy state's metadata holds of the releases (nothing)."""
        return {}

    def load_state_meta(self, meta: dict[str, Any]) -> None:
        """Restore the releases from a state's metadata (nothing to restore)."""


class _Counted(ReleaseAccounting):
    """A DP mode's releases, kept in a ledger of this mode."""

    mode: ClassVar[str]
    ledger: ReleaseLedger

    def __init__(self, config: ExperimentConfig) -> None:
        super().__init__(config)
        self.ledger = ReleaseLedger(self.mode)
        accountant.require_opacus()  # Opacus missing (or a bad target epsilon) fails now
        accountant.noise_multiplier(config)

    def state_meta(self) -> dict[str, Any]:
        """The ledger, with its noise source, under ``privacy``."""
        return {"privacy": self.ledger.to_json()}

    def load_state_meta(self, meta: dict[str, Any]) -> None:
        """The checkpoint's ledger; a state without a ledger of fresh noise of this mode is
        refused (``ReleaseLedger.from_json``)."""
        self.ledger = ReleaseLedger.from_json(meta.get("privacy"), self.mode, "checkpoint")


class LocalReleases(_Counted):
    """Local DP: a release per federated round, counted when its messages are built."""

    mode = "local"

    def dispatched(self, server_round: int, phase: str) -> None:
        """Count the release each sampled client may make in a federated round."""
        if phase == "train":
            self.ledger.record(server_round)

    def round_metrics(self) -> dict[str, float]:
        """The releases so far and their epsilon; each client's noise std sigma C."""
        config = self.config
        std = accountant.noise_multiplier(config) * config.dp_clipping_norm
        return accountant.release_metrics(config, self.ledger.count, std)


class CentralReleases(_Counted):
    """Central DP: a release per noised average (``DPFedAvg``)."""

    mode = "central"
    releases_without_replies = True

    def release(self, server_round: int, std: float) -> dict[str, float]:
        """Count ``server_round``'s noised average (noise std ``std``); its release metrics."""
        self.ledger.record(server_round)
        return accountant.release_metrics(self.config, self.ledger.count, std)


ACCOUNTING: dict[str, type[ReleaseAccounting]] = {
    "none": ReleaseAccounting,
    "local": LocalReleases,
    "central": CentralReleases,
}


def accounting_for(config: ExperimentConfig) -> ReleaseAccounting:
    """The release accounting of ``config``'s ``dp`` mode."""
    return ACCOUNTING[config.dp](config)
