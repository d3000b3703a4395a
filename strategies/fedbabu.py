"""FedBABU (Oh et al. 2022): FedAvg of the body; the head never leaves (nor changes on) a client.

Every client keeps the head at its seeded initialisation, identical on every node, during
federated training and fine-tunes a copy of it before each evaluation
(``client_apps.fedbabu``); the server averages everything else, weighted by examples.
"""

from strategies.fedavg import FedAvgStrategy


class FedBABUStrategy(FedAvgStrategy):
    """FedAvg of every trainable tensor but the head's."""

    local = ("head",)
