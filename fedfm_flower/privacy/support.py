"""Which methods can take central or local differential privacy, and why the others cannot.

Central DP noises the *aggregate* of the shared updates, so it fits a method whose server needs
only that average of the clients' shared tensors: the methods on ``FedAvgStrategy`` whose
clients send their trained shared tensors. A method whose server reads each client's update,
or averages parts over subsets of the clients, is refused at start with the reason.

Local DP noises each client's update before it leaves the client, so whatever the server does
with it is post-processing: it fits every method whose clients send, in the federated rounds
only, their shared tensors or their updates (the FedAvg family, pFedSeq, pFedPG). Methods with
a post-training phase that sends more (FedDPA-F, TAP) and the others are refused. Light: the
config reads it in every process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedfm_flower.config import ExperimentConfig

DP_MODES: tuple[str, ...] = ("none", "central", "local")
FEDAVG = "strategies.fedavg:FedAvgStrategy"
# strategies whose clients send updates or shared tensors in the federated rounds only
LOCAL_DP_STRATEGIES: tuple[str, ...] = (
    FEDAVG,
    "strategies.pfedseq:PFedSeqStrategy",
    "strategies.pfedpg:PFedPGStrategy",
)

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


def dp_refusal(config: ExperimentConfig) -> str | None:
    """Why ``config``'s method cannot take its ``dp`` mode, or None when it can (or dp = none)."""
    if config.dp == "central":
        return central_dp_refusal(config)
    if config.dp == "local":
        return local_dp_refusal(config)
    return None


def local_dp_refusal(config: ExperimentConfig) -> str | None:
    """Why ``config``'s method cannot take local DP, or None when it can."""
    from fedfm_flower.registry import method_spec

    strategy = method_spec(config.method).strategy
    if strategy in LOCAL_DP_STRATEGIES:
        return None
    return (
        f"not yet supported: its strategy {strategy} has phases or replies the local "
        "mechanism does not cover"
    )


def central_dp_refusal(config: ExperimentConfig) -> str | None:
    """Why ``config``'s method cannot take central DP, or None when it can."""
    from fedfm_flower.registry import method_spec

    spec = method_spec(config.method)
    if spec.strategy == FEDAVG:
        return None
    return REFUSALS.get(spec.strategy, f"its strategy {spec.strategy} has no central DP path")
