"""Client-level privacy spent under central or local DP, from Opacus' RDP accountant.

``dp-noise-multiplier`` sigma is the noise's standard deviation in units of the clipping norm
C: sigma C on the sum of clipped updates (central), sigma C on each client's clipped update
(local). What one release can reveal depends on the neighbouring relation, stated per mode:

* **central**: two federations that differ by one client's data added or removed; the sum of
  clipped updates moves by at most C (sensitivity C), so a release is the Gaussian mechanism
  at noise multiplier sigma (DP-FedAvg's, and Flower's DP strategies', relation);
* **local**: two datasets of one client, any two; the clipped update can move anywhere in the
  ball of radius C around what the client received, so two of them differ by up to 2C
  (sensitivity 2C) and a release is the Gaussian mechanism at noise multiplier sigma / 2.
  Flower's ``LocalDpMod`` leaves the sensitivity to its user; taking C would understate
  epsilon under this relation (2 rounds at sigma = 2, delta 1e-5: 7.08, not 3.19).

Each round's metrics say which (``dp-sensitivity``, absolute: C or 2C). Clients are sampled as
a fixed-size seeded draw (``strategies.parts.sampling``), not by Poisson sampling, so no
amplification by subsampling is claimed: each release counts with sampling rate 1, as Flower's
accountant does for its DP strategies (``SamplingMethod.NO_AMPLIFICATION``). The epsilon is
then an upper bound for every client, sampled or not. The releases are counted by the run's
``ReleaseLedger`` (``privacy.ledger``).

Imports inside functions keep ``numpy``, ``opacus`` and ``torch`` out of this module's start-up.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedfm_flower.config.experiment import ExperimentConfig

# L2 sensitivity of one release in units of C, and the neighbouring relation it holds for
SENSITIVITY: dict[str, float] = {"central": 1.0, "local": 2.0}
NEIGHBOURING: dict[str, str] = {
    "central": "one client's data added or removed (the sum of clipped updates moves by <= C)",
    "local": "one client's data replaced by any other (two clipped updates differ by <= 2C)",
}


def epsilon_spent(noise_multiplier: float, rounds: int, delta: float) -> float:
    """epsilon after ``rounds`` noised rounds at ``noise_multiplier``, for ``delta``
    (Opacus' ``RDPAccountant``; infinite without noise)."""
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    if rounds == 0:
        return 0.0
    if noise_multiplier <= 0:
        return float("inf")
    accountant = require_opacus().RDPAccountant()
    accountant.history = [(noise_multiplier, 1.0, rounds)]
    return float(accountant.get_epsilon(delta))


def require_opacus():  # noqa: ANN201 - the opacus.accountants module
    """Opacus' accountants, or an ImportError that says how to install them."""
    try:
        from opacus import accountants
    except ImportError as error:
        raise ImportError(
            "dp = 'central' or 'local' reports the privacy spent with Opacus' accountant: "
            "pip install 'fedfm-flower[dp]' (or pip install opacus)"
        ) from error
    return accountants


def sensitivity(mode: str) -> float:
    """The L2 sensitivity of one release of ``mode`` ('central' or 'local'), in units of C."""
    if mode not in SENSITIVITY:
        raise ValueError(f"no DP release in mode {mode!r}; modes: {', '.join(SENSITIVITY)}")
    return SENSITIVITY[mode]


def noise_multiplier(config: ExperimentConfig) -> float:
    """sigma of the run (noise std in units of C): ``dp-noise-multiplier``, or with
    ``dp-target-epsilon`` > 0 the sigma whose ``num-server-rounds`` releases spend that epsilon
    at ``dp-delta`` and the mode's sensitivity (Opacus' ``get_noise_multiplier``, to its 0.01
    tolerance; local DP's sigma is twice central's for the same target)."""
    if config.dp_target_epsilon <= 0:
        return config.dp_noise_multiplier
    scale = SENSITIVITY.get(config.dp, 1.0)
    calibrated = _calibrated(config.dp_target_epsilon, config.dp_delta, config.num_server_rounds)
    return scale * calibrated


def epsilon_of(config: ExperimentConfig, releases: int) -> float:
    """epsilon after ``releases`` releases of ``config``'s mode at its sigma and ``dp-delta``."""
    effective = noise_multiplier(config) / sensitivity(config.dp)
    return epsilon_spent(effective, releases, config.dp_delta)


def release_metrics(config: ExperimentConfig, releases: int, std: float) -> dict[str, float]:
    """A round's server metrics under DP: the noise std of its release, the releases so far,
    the epsilon they spent and the sensitivity it is stated for (C or 2C)."""
    return {
        "dp-noise-std": std,
        "dp-releases": float(releases),
        "dp-epsilon": epsilon_of(config, releases),
        "dp-sensitivity": sensitivity(config.dp) * config.dp_clipping_norm,
    }


def privacy_spent(config: ExperimentConfig, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A run summary's privacy entries: under central or local DP the settings and the epsilon
    spent by the last noised round of ``rounds`` (the run's records), at ``dp-delta``; none
    without DP."""
    if config.dp == "none":
        return {}
    from fedfm_flower.privacy.noise import NOISE_SOURCE

    released = [r["server"] for r in rounds if "dp-epsilon" in r.get("server", {})]
    last = released[-1] if released else {}
    return {
        "dp": config.dp,
        "dp-delta": config.dp_delta,
        "dp-noise-multiplier": noise_multiplier(config),
        "dp-target-epsilon": config.dp_target_epsilon,
        "dp-clipping-norm": config.dp_clipping_norm,
        "dp-sensitivity": sensitivity(config.dp) * config.dp_clipping_norm,
        "dp-neighbouring": NEIGHBOURING[config.dp],
        "dp-noise": NOISE_SOURCE,
        "dp-releases": int(last.get("dp-releases", 0)),
        "dp-epsilon": last.get("dp-epsilon", 0.0),
    }


@functools.cache
def _calibrated(target_epsilon: float, delta: float, releases: int) -> float:
    require_opacus()
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=1.0,
            steps=releases,
            accountant="rdp",
        )
    )
