"""Local training only: the server sends nothing and aggregates nothing."""

from strategies.fedavg import FedAvgStrategy


class LocalStrategy(FedAvgStrategy):
    """No shared groups: messages carry only the round config; clients keep everything."""

    shared = ()
    local = None
