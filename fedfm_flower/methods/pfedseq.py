"""pFedSeq's run-config keys (``pfedseq-*``): names, defaults, allowed values and rules.

Light (no torch): the config reads it through the method registry in every process, the
ClientApp's included. The server half (``fedfm_flower.learners.pfedseq``) takes a
``PFedSeqSettings``; it and the learners (``sequence``, ``selective_scan``) import their
allowed values from here. What each key means: ``docs/configuration.md#pfedseq``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedfm_flower.methods import Capabilities, MethodSpec, Split
from fedfm_flower.ranges import LogUniform
from fedfm_flower.settings import MethodSettings, setting

LEARNERS: tuple[str, ...] = ("mamba", "lstm", "mlp")  # sequence.SequenceLearner
SCAN_BACKENDS: tuple[str, ...] = ("auto", "torch", "cuda", "compiled", "fused")  # selective_scan
INPUT_SCALES: tuple[str, ...] = ("none", "rms", "rms-rescale")  # pfedseq.PFedSeqServer
LEARNER_UPDATES: tuple[str, ...] = ("full-batch", "mini-batch")  # pfedseq.PFedSeqServer
OUTPUT_INITS: tuple[str, ...] = ("zero", "reference")  # sequence.init_output_projection


@dataclass(frozen=True)
class PFedSeqSettings(MethodSettings):
    """pFedSeq's server hyperparameters: field ``seq_len`` is run-config key ``pfedseq-seq-len``."""

    prefix: ClassVar[str] = "pfedseq"

    seq_len: int = setting(10, positive=True)  # L: rounds of history the learner reads
    warmup_rounds: int = setting(10, non_negative=True)  # W: rounds that send theta_g only
    lr: float = setting(0.001, positive=True)  # Adam on the learners
    learner: str = setting("mamba", choices=LEARNERS)
    num_layers: int = setting(2, positive=True)
    state_dim: int = setting(16, positive=True)
    expand: int = setting(2, positive=True)
    conv_kernel: int = setting(
        4, within=(2, 4), note="the causal-conv1d kernel's range; the paper uses 4"
    )
    mlp_hidden: int = setting(100, positive=True)
    cross_client: bool = setting(True)  # false: variant C
    global_aggregation: bool = setting(True)  # false: variant A
    input_scale: str = setting("none", choices=INPUT_SCALES)
    output_init: str = setting("zero", choices=OUTPUT_INITS)
    learner_update: str = setting("full-batch", choices=LEARNER_UPDATES)
    batch_rows: int = setting(32, positive=True)  # rows per Adam step of mini-batch updates
    chunk_size: int = setting(0, non_negative=True)  # rows per learner chunk; 0: automatic
    scan_backend: str = setting("auto", choices=SCAN_BACKENDS)


# Tuned besides the common training keys (fedfm_flower.search): the sequential learner's Adam step,
# a decade each way of the paper's.
SEARCH = {"pfedseq-lr": LogUniform(1e-4, 1e-2)}

CAPABILITIES = Capabilities(
    central_dp="its sequential learner reads each client's update (eqs. 2 and 5), not only "
    "their average",
    local_dp=None,  # each client's noised update is all the learner reads
    secagg="its sequential learner reads each client's update (eqs. 2 and 5), which needs "
    "more than their sum (SecAgg+ reveals only that sum)",
)

SPECS = (
    MethodSpec(
        "pfedseq",
        strategy="strategies.pfedseq:PFedSeqStrategy",
        client="client_apps.updates:UpdateClient",
        summary="FedAvg of LoRA updates + a Mamba sequential learner's per-client calibrations "
        "(Peng et al. 2025)",
        settings=PFedSeqSettings,
        # Clients send the adapter update Delta_i^t; the head is trained jointly and kept.
        split=Split(shared=("adapter",), local=("head",)),
        search=SEARCH,
        capabilities=CAPABILITIES,
    ),
)
