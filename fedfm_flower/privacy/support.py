"""Which methods can take central differential privacy, and why the others cannot (light).

Central DP noises the *aggregate* of the shared updates, so it fits a method whose server needs
only that average of the clients' shared tensors: the methods on ``FedAvgStrategy`` whose
clients send their trained shared tensors. A method whose server reads each client's update,
or averages parts over subsets of the clients, is refused at start with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedfm_flower.config import ExperimentConfig

DP_MODES: tuple[str, ...] = ("none", "central")
FEDAVG = "strategies.fedavg:FedAvgStrategy"

# strategy path -> why its server cannot work from a noised average alone
REFUSALS: dict[str, str] = {
    "strategies.pfedseq:PFedSeqStrategy": "its sequential learner reads each client's update "
    "(eqs. 2 and 5), not only their average",
    "strategies.pfedpg:PFedPGStrategy": "its prompt generator is trained on each client's "
    "update, not only their average",
    "strategies.tap:TAPStrategy": "it averages each component over the clients that own it, "
    "so a component's average rests on a few clients and no single noise scale covers all",
    "strategies.feddpa:FedDPAStrategy": "not yet supported: its global adapter could take "
    "central DP, but that path is not implemented and tested",
    "strategies.feddpa:FedDPAFineTuneStrategy": "not yet supported (as FedDPA)",
    "strategies.feddat:FedDATStrategy": "not yet supported: FedDAT's server distils between "
    "adapters it keeps per round",
    "strategies.centralized:CentralizedStrategy": "the centralized reference pools all data in "
    "one client; there is nothing to aggregate",
}


def central_dp_refusal(config: ExperimentConfig) -> str | None:
    """Why ``config``'s method cannot take central DP, or None when it can."""
    from fedfm_flower.registry import method_spec

    spec = method_spec(config.method)
    if spec.strategy == FEDAVG:
        return None
    return REFUSALS.get(spec.strategy, f"its strategy {spec.strategy} has no central DP path")
