"""pFedPG's run-config keys (``pfedpg-*``): names, defaults, allowed values and rules.

Light (no torch): the config reads it through the method registry in every process, the
ClientApp's included. The server half (``fedfm_flower.learners.pfedpg``) takes a
``PFedPGSettings`` and imports its allowed values from here. ``vpt-num-prompts`` is not here:
the other prompt methods read it too, so it is a common key. What each key means:
``docs/configuration.md#visual-prompts-and-pfedpg``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import Capabilities, MethodSpec, Split
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, setting

GENERATORS: tuple[str, ...] = ("cross-attention", "basis", "mlp", "adain")
QUERIES: tuple[str, ...] = ("per-prompt", "single")


@dataclass(frozen=True)
class PFedPGSettings(MethodSettings):
    """pFedPG's server hyperparameters: field ``lr`` is run-config key ``pfedpg-lr``."""

    prefix: ClassVar[str] = "pfedpg"

    lr: float = setting(
        0.001,
        positive=True,
        doc=(
            "Adam learning rate of the server's prompt generator, basis and descriptors, one step "
            "per round (> 0)"
        ),
    )
    generator: str = setting(
        "cross-attention",
        choices=GENERATORS,
        doc=(
            "`cross-attention` (the paper, eq. 3), `basis` (every client gets P_base; Table 4 "
            '"P_base"), `mlp` (pFedHN-style MLP on the descriptor; Table 4), `adain` (client mean '
            "and scale of P_base; Table 4)"
        ),
    )
    query: str = setting(
        "per-prompt",
        choices=QUERIES,
        doc=(
            "descriptor shape of the `cross-attention` generator: `per-prompt` (K query tokens "
            "per client) or `single` (one query vector, the paper's literal eq. 3: all K prompts "
            "shifted alike)"
        ),
    )
    attention_dim: int = setting(
        0,
        non_negative=True,
        doc="internal width l_k = l_v of the cross-attention; `0` is the prompt width (>= 0)",
    )
    hidden: int = setting(
        100,
        positive=True,
        doc="hidden width of the `mlp` generator, also its descriptors' width (> 0)",
    )


# Tuned besides the common training keys (fedfm_flower.study.search): the generator's Adam step, a
# decade below the default (the paper's 0.001) and 30x above (glyphs-many-clients chose 0.008 of the
# decade's 0.01).
SEARCH = {"pfedpg-lr": LogUniform(1e-4, 3e-2)}

CAPABILITIES = Capabilities(
    central_dp="its prompt generator is trained on each client's update, not only their average",
    local_dp=None,  # each client's noised update is all the generator reads
    secagg="its prompt generator is trained on each client's update, which needs more than "
    "their sum (SecAgg+ reveals only that sum)",
)

SPECS = (
    MethodSpec(
        "pfedpg",
        strategy="strategies.pfedpg:PFedPGStrategy",
        client="client_apps.updates:UpdateClient",
        summary="server-side prompt generator (cross-attention over a prompt basis) personalizes "
        "visual prompts (Yang et al. 2023)",
        settings=PFedPGSettings,
        tuner="vpt",
        # Clients send the prompt change Delta P_n; the head is trained jointly and kept.
        split=Split(shared=("prompt",), local=("head",)),
        search=SEARCH,
        capabilities=CAPABILITIES,
    ),
)
