"""APFL (Deng et al. 2020): FedAvg of the global model w; the personal v and alpha stay local.

The server half is plain FedAvg of every trainable tensor (the clients' updated copies of w,
weighted by examples); each client's personal model v_i and mixing weight alpha_i live in its
client state (``client_apps.apfl``).
"""

from strategies.fedavg import FedAvgStrategy


class APFLStrategy(FedAvgStrategy):
    """FedAvg of the global model; the personal models never reach the server."""
