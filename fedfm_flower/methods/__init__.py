"""Methods, one light module each: what a method is, in one place.

A module here (``fedfm_flower/methods/<name>.py``) declares one method, or a method and its
variants that share its settings (``feddpa-t``/``feddpa-f``), as ``SPECS``: a tuple of
``MethodSpec``. A spec names the method's server and client halves by import path, its tuner and
modalities, its settings class (declared in the same module), what its clients share with the
server and what they keep (``Split``, or a function of the run config), and its resource profile
(``ResourceProfile``). The registry (``fedfm_flower.methods.registry``) is built from every module
of this package that has ``SPECS``, so adding a method adds a module here and edits no list.

Modules here import neither torch nor flwr: the ClientApp parses the run config, and with it
every method's settings, in a fresh process per message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedfm_flower.methods.ranges import Range
    from fedfm_flower.methods.settings import MethodSettings, RunConfig


def descriptor_size(embedding_dim: int, num_clients: int) -> int:
    """A client descriptor's size in a hypernetwork method (pFedHN, PeFLL): ``embedding_dim``,
    or the pFedHN authors' int(1 + N / 4) when it is 0."""
    return embedding_dim or int(1 + num_clients / 4)


@dataclass(frozen=True)
class Split:
    """What a method's clients send to the server (``shared``) and keep (``local``).

    Each side is a selection of parameter groups or name patterns
    (``fedfm_flower.models.groups.select_names``); ``None`` means every trainable parameter the
    other side does not select. ``strict``: an entry that selects nothing is an error (the
    selection comes from the run-config key ``key``, named in that error).
    """

    shared: tuple[str, ...] | None = None
    local: tuple[str, ...] | None = ()
    strict: bool = False
    key: str = ""


@dataclass(frozen=True)
class ResourceProfile:
    """What a client keeps and computes beyond its model (FedPerfix's Table 2 columns)."""

    # Copies of the trainable tensors a client stores (APFL: v and w), or a function of the run
    # config where they grow with it (APPLE: every client's core and their mixture).
    copies: int | Callable[[RunConfig], int] = 1
    passes: int = 1  # forward-backward passes per training step (APFL, Per-FedAvg: 2)
    extra: int = 0  # further parameters a client stores (APFL's mixing weight alpha)
    # Parameter groups a client keeps a second copy of beside the model's own (FedRoD's personal
    # head h_P, the shape of the model's ``head``).
    copied_groups: tuple[str, ...] = ()
    # Where a round's messages carry more than the shared tensors once each way: (run config,
    # parameters of the shared tensors, classes) -> (upload, download) per client and round.
    traffic: Callable[[RunConfig, int, int], tuple[int, int]] | None = None

    def copies_for(self, config: RunConfig) -> int:
        """The copies a client of ``config``'s run stores."""
        return self.copies(config) if callable(self.copies) else self.copies


@dataclass(frozen=True)
class Capabilities:
    """Which privacy mechanisms a method's federation takes: None where it does, else the
    reason it does not (what a run config asking for it is refused with).

    Central DP noises the average of the clients' shared tensors on the server; local DP noises
    each client's reply before it leaves; SecAgg+ reveals only the sum of the shared tensors
    (``fedfm_flower.privacy``). The dataset may refuse more (SecAgg+ on ``multitask``).
    """

    central_dp: str | None
    local_dp: str | None
    secagg: str | None

    def refusal(self, mechanism: str) -> str | None:
        """Why the method does not take ``mechanism`` (central-dp, local-dp, secagg), or None."""
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism '{mechanism}' unknown; known: {', '.join(MECHANISMS)}")
        return getattr(self, mechanism.replace("-", "_"))


MECHANISMS: tuple[str, ...] = ("central-dp", "local-dp", "secagg")

# The server needs only the (weighted) average of the clients' shared tensors, which they send
# in the federated rounds only: every mechanism fits (the FedAvg family, Local).
AVERAGE_ONLY = Capabilities(central_dp=None, local_dp=None, secagg=None)

# A spec that declares nothing takes none of them.
UNDECLARED = Capabilities(
    central_dp="its spec declares no central DP support (MethodSpec.capabilities)",
    local_dp="its spec declares no local DP support (MethodSpec.capabilities)",
    secagg="its spec declares no SecAgg+ support (MethodSpec.capabilities)",
)


@dataclass(frozen=True)
class MethodSpec:
    """One method: its halves, its tuner and modalities, its settings, its split, its profile.

    ``strategy`` and ``client`` are ``"module:Class"`` paths, imported on demand so the ClientApp
    imports only its own half.
    """

    name: str
    strategy: str
    client: str
    summary: str
    settings: type[MethodSettings] | None = None  # its keys <prefix>-*; None: no keys of its own
    tuner: str = "lora"  # what it adds to the backbone (fedfm_flower.models.tuners.registry.TUNERS)
    # The whole ViT trains (else only when train-backbone = true). On a backbone of another
    # family, which is adapter-tuned only, such a method with tuner "none" trains the family's
    # LoRA instead; one with a ViT tuner of its own (FedPerfix) needs a ViT.
    trains_backbone: bool = False
    modalities: tuple[str, ...] = ()  # input modalities it serves; () means every one
    split: Split | Callable[[RunConfig], Split] = Split()
    profile: ResourceProfile = ResourceProfile()
    # Names of the method's own message entries beside the model's tensors start with this
    # (APPLE's other clients' cores, PeFLL's networks); "": its messages hold model tensors only.
    message_prefix: str = ""
    # What tuning searches besides the common training keys (fedfm_flower.study.search): run-config
    # key -> range; an entry for a common key (lr) replaces the common range.
    search: Mapping[str, Range] = field(default_factory=dict, compare=False)
    # Ends of those ranges that are the limit of the key, not a choice (a chosen value there
    # asks for no wider range; the report says why): (key, "bottom" | "top") -> why.
    search_limits: Mapping[tuple[str, str], str] = field(default_factory=dict, compare=False)
    # Which of central DP, local DP and SecAgg+ its federation takes, and why not the others.
    capabilities: Capabilities = UNDECLARED
    # Why it cannot run on a model whose BatchNorms carry running statistics (a ResNet,
    # fedfm_flower.models.groups); "": it can (the statistics travel with their layer).
    no_batchnorm: str = ""

    def split_for(self, config: RunConfig) -> Split:
        """The split of a run of this method (a function of ``config`` for some methods)."""
        return self.split if isinstance(self.split, Split) else self.split(config)
