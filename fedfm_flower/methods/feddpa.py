"""FedDPA's run-config keys (``feddpa-*``): the mixing weight, the dynamic weighting, FedProx.

Light (no torch): the config reads it through the method registry in every process, the
ClientApp's included. The methods are ``feddpa-f`` and ``feddpa-t`` (``client_apps.feddpa``,
``strategies.feddpa``); their defaults are the paper's (sec. 5.1, A.2, B.1-B.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, Split
from fedfm_flower.methods.ranges import Uniform, When
from fedfm_flower.methods.settings import ConfigError, MethodSettings, setting

WEIGHTINGS: tuple[str, ...] = ("dynamic", "fixed")
SIMILARITIES: tuple[str, ...] = ("cosine", "neg-l2", "pearson")  # Table 9
REPRESENTATIONS: tuple[str, ...] = ("last", "avg")  # Table 10
DIRECTIONS: tuple[str, ...] = ("local", "global")  # which adapter alpha_t weighs


@dataclass(frozen=True)
class FedDPASettings(MethodSettings):
    """FedDPA's keys: field ``instances`` is run-config key ``feddpa-instances``."""

    prefix: ClassVar[str] = "feddpa"

    # FedDPA-T's training mixture (1 - alpha) Delta_g + alpha Delta_l: 0.5 on federated dataset 1,
    # 0.3 on dataset 2 (sec. 5.1). Also the fixed inference weight of the local adapter when
    # feddpa-weighting = fixed (Table 3's "w/o Auto"), for FedDPA-F as for FedDPA-T.
    alpha: float = setting(
        0.5,
        within=(0.0, 1.0),
        note="alpha weights the local adapter",
        doc=(
            "FedDPA-T's training mixture `(1 - alpha) Δg + alpha Δl`, in [0, 1] (the paper: 0.5 "
            "on its dataset 1, 0.3 on dataset 2); also the fixed inference weight of the local "
            'adapter when `feddpa-weighting = "fixed"`'
        ),
    )
    # "dynamic": alpha_t = lambda * mean similarity per test instance (sec. 4.3); "fixed": alpha.
    weighting: str = setting(
        "dynamic",
        choices=WEIGHTINGS,
        doc=(
            "`dynamic`: every test instance gets `alpha_t = lambda * mean similarity` to "
            "`feddpa-instances` of the client's training instances (sec. 4.3); `fixed`: "
            '`feddpa-alpha` for every instance (the paper\'s "w/o Auto")'
        ),
    )
    # lambda of sec. 4.3: "auto" is the paper's, 1 for FedDPA-F and alpha for FedDPA-T (A.2);
    # or a number in (0, 1].
    scale: str = setting(
        "auto",
        doc=(
            "lambda of sec. 4.3: `auto` is the paper's (1 for FedDPA-F, `feddpa-alpha` for "
            "FedDPA-T), or a number in (0, 1]"
        ),
        example="0.7",
    )
    # S, the local training instances each test instance is compared with (sec. 5.1: 5).
    instances: int = setting(
        5, positive=True, doc="S, the training instances each test instance is compared with (> 0)"
    )
    similarity: str = setting(
        "cosine",
        choices=SIMILARITIES,
        doc=(
            "`cosine`, `neg-l2` or `pearson` (Table 9), each mapped to [0, 1] "
            "([how](methods/feddpa.md#choices-the-paper-leaves-open))"
        ),
    )
    representation: str = setting(
        "last",
        choices=REPRESENTATIONS,
        doc=(
            "the final layer's hidden state of the prompt's `last` token, or the `avg` over its "
            "tokens (Table 10)"
        ),
    )
    # The adapter alpha_t weighs: "local" (the paper's text; fedfm_flower.models.dynamic_mix
    # says why) or "global" (how the authors' released code is reported to apply it).
    direction: str = setting(
        "local",
        choices=DIRECTIONS,
        doc=(
            "the adapter `alpha_t` weighs: `local` (the paper's text) or `global` (how the "
            "authors' released code is reported to apply it); "
            "[why](methods/feddpa.md#choices-the-paper-leaves-open)"
        ),
    )
    # FedProx's mu for the global adapter's local training (B.1); 0 is FedAvg's local step.
    prox_mu: float = setting(
        0.0,
        non_negative=True,
        doc="FedProx's mu for the global adapter's local training (B.1); 0 is plain FedAvg",
    )

    def check(self) -> None:
        """``scale`` is 'auto' or a number in (0, 1]."""
        if self.scale == "auto":
            return
        try:
            value = float(self.scale)
        except ValueError:
            value = float("nan")
        if not 0.0 < value <= 1.0:
            raise ConfigError(self.key_of("scale"), self.scale, "'auto' or a number in (0, 1]")

    def lambda_for(self, trains_local_each_round: bool) -> float:
        """lambda of sec. 4.3: ``scale``, or for 'auto' alpha (FedDPA-T) or 1 (FedDPA-F)."""
        if self.scale != "auto":
            return float(self.scale)
        return self.alpha if trains_local_each_round else 1.0


# The global adapter travels; the local one never leaves the client.
_ADAPTERS = Split(shared=("adapter.global",), local=("adapter.local",))

# Tuned besides the common training keys (fedfm_flower.study.search): the local adapter's weight in
# training (FedDPA eq. 6). FedDPA-F mixes nothing in training and its dynamic weighting's lambda
# is 1, so there alpha only matters as the fixed inference weight.
ALPHA = Uniform(0.1, 0.9)

# The server needs only the equal-weight average of the global adapters, sent in the federated
# rounds; FedDPA-F's post-training round sends nothing up and releases nothing (its local
# fine-tuning stays on the client). Central DP's DP-FedAvg divides by the sampled clients, which
# is eq. 2's equal weights; SecAgg+ sums with weight 1 each.
CAPABILITIES = AVERAGE_ONLY

SPECS = (
    MethodSpec(
        "feddpa-t",
        strategy="strategies.feddpa:FedDPAStrategy",
        client="client_apps.feddpa:FedDPAClient",
        summary="global LoRA federated (equal client weights), local LoRA trained alongside it "
        "every round and kept; adapters mixed per test instance (Yang et al. 2024, Algorithm 2)",
        settings=FedDPASettings,
        tuner="dual-lora",
        modalities=("text",),
        split=_ADAPTERS,
        search={"feddpa-alpha": ALPHA},
        capabilities=CAPABILITIES,
    ),
    MethodSpec(
        "feddpa-f",
        strategy="strategies.feddpa:FedDPAFineTuneStrategy",
        client="client_apps.feddpa:FedDPAFineTuneClient",
        summary="global LoRA federated (equal client weights), then a local LoRA fine-tuned from "
        "it after the last round; adapters mixed per test instance (Yang et al. 2024, "
        "Algorithm 1)",
        settings=FedDPASettings,
        tuner="dual-lora",
        modalities=("text",),
        split=_ADAPTERS,
        search={"feddpa-alpha": When(ALPHA, "feddpa-weighting", ("fixed",))},
        capabilities=CAPABILITIES,
    ),
)
