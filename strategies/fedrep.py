"""FedRep: the adapter (the representation) is averaged, the head never leaves the client."""

from strategies.fedavg import FedAvgStrategy


class FedRepStrategy(FedAvgStrategy):
    """FedAvg of everything but the heads, which stay in client state."""

    local = ("head",)
