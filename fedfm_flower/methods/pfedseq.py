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
from fedfm_flower.methods.ranges import LogUniform
from fedfm_flower.methods.settings import MethodSettings, setting

LEARNERS: tuple[str, ...] = ("mamba", "lstm", "mlp")  # sequence.SequenceLearner
SCAN_BACKENDS: tuple[str, ...] = ("auto", "torch", "cuda", "compiled", "fused")  # selective_scan
INPUT_SCALES: tuple[str, ...] = ("none", "rms", "rms-rescale")  # pfedseq.PFedSeqServer
LEARNER_UPDATES: tuple[str, ...] = ("full-batch", "mini-batch")  # pfedseq.PFedSeqServer
OUTPUT_INITS: tuple[str, ...] = ("zero", "reference")  # sequence.init_output_projection


@dataclass(frozen=True)
class PFedSeqSettings(MethodSettings):
    """pFedSeq's server hyperparameters: field ``seq_len`` is run-config key ``pfedseq-seq-len``."""

    prefix: ClassVar[str] = "pfedseq"

    seq_len: int = setting(
        10,
        positive=True,
        doc=(
            "maximum sequence length L: the server keeps the last L rounds of client updates as "
            "the learner's input (> 0); also the MLP learner's fixed input length; `1` is variant "
            "B"
        ),
    )
    warmup_rounds: int = setting(
        10,
        non_negative=True,
        doc=(
            "warm-up W: for the first W server steps every client gets the global (FedAvg) "
            "adapter while the learner is already trained (>= 0; the paper's 10)"
        ),
    )
    lr: float = setting(
        0.001, positive=True, doc="Adam learning rate of the server's learners (> 0)"
    )
    learner: str = setting(
        "mamba",
        choices=LEARNERS,
        doc="learner architecture: `mamba` (the paper), `lstm` (variant E), `mlp` (variant D)",
    )
    num_layers: int = setting(
        2,
        positive=True,
        doc="residual blocks of the `mamba`/`lstm` learner (> 0; the MLP ignores it)",
    )
    state_dim: int = setting(16, positive=True, doc="SSM state size M of each Mamba block (> 0)")
    expand: int = setting(
        2,
        positive=True,
        doc=(
            "Mamba in-projection expansion (inner width = expand x clients); LSTM hidden size = "
            "expand x clients (> 0)"
        ),
    )
    conv_kernel: int = setting(
        4,
        within=(2, 4),
        note="the causal-conv1d kernel's range; the paper uses 4",
        doc="Mamba's causal conv1d kernel size, in [2, 4]",
    )
    mlp_hidden: int = setting(100, positive=True, doc="hidden width of the `mlp` learner (> 0)")
    cross_client: bool = setting(
        True, doc="`false`: each client's calibration from its own updates only (variant C)"
    )
    global_aggregation: bool = setting(
        True,
        doc=(
            "`false`: after the warm-up a client's adapter is the learner's output itself, not "
            "the global adapter plus it (variant A)"
        ),
    )
    input_scale: str = setting(
        "none",
        choices=INPUT_SCALES,
        doc=(
            "units of the learner's input and output: `none` (the paper: raw updates in, the "
            "output is the calibration), `rms` (input divided by the RMS of the reported updates "
            "per layer and window, per client for variant C; output as is), `rms-rescale` (as "
            "`rms`, output multiplied back; the earlier default, calibrations ~1% of an update)"
        ),
    )
    output_init: str = setting(
        "zero",
        choices=OUTPUT_INITS,
        doc=(
            "initialisation of the learners' output projections: `zero` (untrained learner: xi = "
            "0), `reference` (Gu & Dao's Kaiming-uniform / sqrt(num-layers); PyTorch's default "
            "for the MLP)"
        ),
    )
    learner_update: str = setting(
        "full-batch",
        choices=LEARNER_UPDATES,
        doc=(
            "`full-batch`: one Adam step per round on the surrogate over all adapter parameters; "
            "`mini-batch`: ceil(D / `pfedseq-batch-rows`) Adam steps per layer and round on "
            "shuffled rows (the paper's appendix A read literally)"
        ),
    )
    batch_rows: int = setting(
        32,
        positive=True,
        doc=(
            'rows (adapter parameters) per Adam step with `pfedseq-learner-update = "mini-batch"` '
            "(> 0)"
        ),
    )
    chunk_size: int = setting(
        0,
        non_negative=True,
        doc=(
            "adapter parameters per learner chunk on the server; `0` sizes chunks by the device "
            "(CUDA: 40% of its free memory; CPU: ~2^26 activation elements, at most a quarter of "
            "the available RAM); bounds memory, does not change results (>= 0)"
        ),
    )
    scan_backend: str = setting(
        "auto",
        choices=SCAN_BACKENDS,
        doc=(
            "`auto` (mamba-ssm / causal-conv1d CUDA kernels when installed, `pip install -e "
            ".[cuda]`, and the learner is on a GPU; the fused C scan on a CPU where `cc` builds "
            "it; else PyTorch), `torch` (the eager loop), `cuda` (kernels or an error), "
            "`compiled` (the PyTorch scan with each step compiled by `torch.compile`, compiled "
            "when the server starts; needs a C++ compiler), `fused` (the C scan with the state in "
            "registers over the window, or an error at start)"
        ),
    )


# Tuned besides the common training keys (fedfm_flower.study.search): the sequential learner's Adam
# step, a decade each way of the paper's.
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
