"""FedRep: the adapter (the representation) is averaged, the head never leaves the client."""

from strategies.fedavg import FedAvgStrategy


class FedRepStrategy(FedAvgStrategy):
    """FedAvg restricted to the adapter; heads stay in client state."""

    shared_groups = ("adapter",)
