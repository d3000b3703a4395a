"""FedRep (Collins et al. 2021): the adapter (the representation) averaged, the head kept local;
head epochs with the adapter fixed, then adapter epochs with the head fixed."""

from __future__ import annotations

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, Split
from fedfm_flower.methods.ranges import IntRange

# Tuned besides the common training keys (fedfm_flower.study.search): head epochs before the
# adapter's (FedRep trains the head longest).
SEARCH = {"head-epochs": IntRange(1, 5)}

SPECS = (
    MethodSpec(
        "fedrep",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.fedrep:FedRepClient",
        summary="adapter averaged, head local; head epochs then adapter epochs (Collins et al. "
        "2021)",
        split=Split(shared=None, local=("head",)),
        search=SEARCH,
        capabilities=AVERAGE_ONLY,
    ),
)
