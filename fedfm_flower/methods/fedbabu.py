"""FedBABU (Oh et al. 2022), as FedPerfix's Table 2 runs it on a whole ViT: FedAvg of the body;
the head stays at its seeded initialisation (never sent nor stored), fine-tuned only to
evaluate."""

from __future__ import annotations

from fedfm_flower.methods import AVERAGE_ONLY, MethodSpec, Split

SPECS = (
    MethodSpec(
        "fedbabu",
        strategy="strategies.fedavg:FedAvgStrategy",
        client="client_apps.fedbabu:FedBABUClient",
        summary="the whole ViT trains with the head frozen at its init; FedAvg of the body, head "
        "fine-tuned before evaluation (Oh et al. 2022; FedPerfix Table 2)",
        tuner="none",
        trains_backbone=True,
        modalities=("image",),  # it needs a classification head
        split=Split(shared=None, local=("head",)),
        capabilities=AVERAGE_ONLY,
    ),
)
