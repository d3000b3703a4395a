"""FedVPT and FedVPT-deep (pFedPG's baselines): visual prompts averaged, heads local."""

from strategies.fedavg import FedAvgStrategy


class FedVPTStrategy(FedAvgStrategy):
    """FedAvg of the prompts (VPT-shallow or VPT-deep, per the method's tuner); heads local."""

    local = ("head",)
