"""Client-level privacy spent by central DP, from Opacus' RDP accountant.

Each noised round is one release of the Gaussian mechanism with noise multiplier sigma on the
sum of clipped updates (sensitivity C, one client added or removed). Clients are sampled as a
fixed-size seeded draw (``strategies.parts.sampling``), not by Poisson sampling, so no
amplification by subsampling is claimed: each round counts with sampling rate 1, as Flower's
accountant does for its DP strategies (``SamplingMethod.NO_AMPLIFICATION``). The epsilon is
then an upper bound for every client, sampled or not.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedfm_flower.config import ExperimentConfig


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


def noise_multiplier(config: ExperimentConfig) -> float:
    """sigma of the run: ``dp-noise-multiplier``, or with ``dp-target-epsilon`` > 0 the sigma
    whose ``num-server-rounds`` releases spend that epsilon at ``dp-delta`` (Opacus'
    ``get_noise_multiplier``, to its 0.01 tolerance)."""
    if config.dp_target_epsilon <= 0:
        return config.dp_noise_multiplier
    return _calibrated(config.dp_target_epsilon, config.dp_delta, config.num_server_rounds)


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


def local_dp_metrics(config: ExperimentConfig, server_round: int) -> dict[str, float]:
    """Round ``server_round``'s server metrics under local DP: every client has released at most
    once per round, so the epsilon of ``server_round`` releases bounds them all."""
    sigma = noise_multiplier(config)
    return {
        "dp-noise-std": sigma * config.dp_clipping_norm,
        "dp-releases": float(server_round),
        "dp-epsilon": epsilon_spent(sigma, server_round, config.dp_delta),
    }
