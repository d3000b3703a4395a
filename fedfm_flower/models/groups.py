"""Named parameter groups, declared by patterns where the parameters are defined.

Every trainable part of a model declares the names of its parameters with a regular expression
and the group they belong to: the LoRA tuner declares ``adapter`` for ``.lora_A.default.`` and
``.lora_B.default.`` weights, the classification head ``head`` for ``^head\\.``. Group names
are open and dotted: ``adapter``, ``adapter.global``, ``adapter.local``, ``prompt``, ``head``,
``encoder.image``, ``expert.3``. Asking for a group also selects its dotted children
(``adapter`` selects ``adapter.global`` and ``adapter.local``). A parameter no pattern claims is
backbone: frozen and never sent anywhere.

A BatchNorm layer's running statistics (``running_mean``, ``running_var``) are no parameters,
yet they are part of what its layer computes: they belong to the group of the layer's affine
``weight`` and travel, average and stay local exactly as it does (FedAvg averages them, FedBN
keeps them on the client, as the FedBN paper's local BN layers). They are *carried tensors*:
named beside the parameters (``parameter_groups``, ``trainable``, ``tensors_named``,
``load_tensors``) but never handed to an optimizer or a penalty (``group_parameters`` and
``parameters_named`` return parameters only). ``num_batches_tracked`` stays with the model: it
only matters for a BatchNorm without momentum. A loaded running variance below 0 (an average
noised for DP) is set to 0. A BatchNorm whose weight is backbone is frozen whole: it stays in
eval mode while the model trains, so its statistics do not drift either.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

BACKBONE = "backbone"
_GROUP_NAME = re.compile(r"^[a-z][a-z0-9-]*(\.[a-z0-9][a-z0-9-]*)*$")


@dataclass(frozen=True)
class GroupPattern:
    """Parameters whose name matches ``pattern`` (``re.search``) belong to ``group``."""

    group: str
    pattern: str

    def __post_init__(self) -> None:
        check_group_name(self.group)
        re.compile(self.pattern)


def check_group_name(name: str) -> str:
    """``name`` when it is a valid group name (lowercase, dotted), else a ValueError."""
    if not _GROUP_NAME.match(name) or name == BACKBONE:
        raise ValueError(
            f"parameter group name {name!r} is invalid: use lowercase dotted names such as "
            "'adapter', 'adapter.local' or 'expert.3' ('backbone' is reserved)"
        )
    return name


def in_groups(group: str, wanted: Iterable[str]) -> bool:
    """True when ``group`` is one of ``wanted`` or a dotted child of one."""
    return any(group == w or group.startswith(w + ".") for w in wanted)


def group_of(name: str, patterns: Iterable[GroupPattern]) -> str:
    """The group of parameter ``name`` (first matching pattern), or 'backbone'."""
    for declared in patterns:
        if re.search(declared.pattern, name):
            return declared.group
    return BACKBONE


def select_names(
    entries: Iterable[str], groups: Mapping[str, str], *, strict: bool = False
) -> list[str]:
    """Parameter names (in ``groups`` order) that ``entries`` select.

    An entry that is a group name selects that group and its dotted children; any other entry
    is a regular expression searched in the parameter names (``blocks\\.11\\.``). With
    ``strict``, an entry that selects nothing is a ValueError naming it and the groups present.
    """
    chosen: set[str] = set()
    for entry in entries:
        if _GROUP_NAME.match(entry):
            found = {n for n, g in groups.items() if in_groups(g, (entry,))}
        else:
            try:
                pattern = re.compile(entry)
            except re.error as err:
                msg = f"parameter pattern {entry!r} is not a regular expression: {err}"
                raise ValueError(msg) from err
            found = {n for n in groups if pattern.search(n)}
        if strict and not found:
            present = ", ".join(dict.fromkeys(groups.values()))
            raise ValueError(
                f"{entry!r} selects no trainable parameter; groups present: {present} "
                "(or give a regular expression over parameter names)"
            )
        chosen |= found
    return [n for n in groups if n in chosen]


def split_names(
    groups: Mapping[str, str],
    shared: Iterable[str] | None,
    local: Iterable[str] | None,
    *,
    strict: bool = False,
) -> tuple[list[str], list[str]]:
    """(shared names, local names) of the parameters in ``groups``.

    ``shared``/``local`` are selections as in ``select_names``; ``None`` means every parameter
    the other side does not select (FedAvg: ``local=()``, ``shared=None``). A name both sides
    select is received from the server and also kept in client state.
    """
    if shared is None and local is None:
        raise ValueError("at most one of shared and local may be 'the rest'")
    local_names = select_names(local, groups, strict=strict) if local is not None else None
    shared_names = select_names(shared, groups, strict=strict) if shared is not None else None
    if local_names is None:
        taken = set(shared_names)
        local_names = [n for n in groups if n not in taken]
    if shared_names is None:
        taken = set(local_names)
        shared_names = [n for n in groups if n not in taken]
    return shared_names, local_names


def serving(
    groups: Mapping[str, str], users: Mapping[str, frozenset[str]], holds: Iterable[str]
) -> list[str]:
    """Names whose group serves a holder of ``holds`` (a group ``users`` does not list serves
    everyone; empty ``holds``: every name)."""
    held = set(holds)
    if not held:
        return list(groups)
    return [n for n, g in groups.items() if g not in users or users[g] & held]


@dataclass(frozen=True)
class TrainableTensors:
    """A model's trainable tensors in model order, with the group of each and, for models whose
    components serve only some holdings (TAP's modality-task pairs), the users of each group."""

    tensors: Mapping[str, torch.Tensor]
    groups: Mapping[str, str]
    users: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def names_for(self, holds: Iterable[str]) -> list[str]:
        """The tensor names a client holding ``holds`` owns (all of them when ``holds`` is
        empty)."""
        return serving(self.groups, self.users, holds)

    def select(self, groups: Iterable[str]) -> dict[str, torch.Tensor]:
        """Clones of the tensors of ``groups`` (and their dotted children), in model order."""
        wanted = tuple(groups)
        return {n: t.clone() for n, t in self.tensors.items() if in_groups(self.groups[n], wanted)}

    def group_names(self) -> tuple[str, ...]:
        """The groups present, in order of first appearance."""
        return tuple(dict.fromkeys(self.groups.values()))


class TunedModel(nn.Module):
    """A frozen backbone plus trainable parts that declare their parameter groups.

    Subclasses set ``self.group_patterns`` in ``__init__`` (after building their parts).
    """

    def __init__(self) -> None:
        super().__init__()
        self.group_patterns: tuple[GroupPattern, ...] = ()
        self._index: list[tuple[str, torch.Tensor, str]] | None = None
        # Derived from _index and dropped with it: name -> parameter and name -> group of the
        # grouped (non-backbone) parameters, in model order.
        self._grouped: tuple[dict[str, torch.Tensor], dict[str, str]] | None = None
        self._frozen_norms: list[nn.Module] = []  # BatchNorms of the backbone (eval always)

    def _group_index(self) -> list[tuple[str, torch.Tensor, str]]:
        if self._index is None:
            # Walking every module for named_parameters() cost ~1 ms per call and a message
            # makes several calls: the (name, tensor, group) list is built once.
            carried, self._frozen_norms = self._batchnorms()
            self._index = [
                (n, p, group_of(n, self.group_patterns)) for n, p in self.named_parameters()
            ] + carried
            self._grouped = None
        return self._index

    def _batchnorms(self) -> tuple[list[tuple[str, torch.Tensor, str]], list[nn.Module]]:
        """One walk over the BatchNorms: (name, buffer, group) of the running statistics of
        those whose weight is grouped (they follow the weight's group, module docstring), and
        those of the backbone (kept in eval mode)."""
        carried: list[tuple[str, torch.Tensor, str]] = []
        frozen: list[nn.Module] = []
        for prefix, module in self.named_modules():
            if not _tracks_statistics(module):
                continue
            group = group_of(f"{prefix}.weight", self.group_patterns)
            if group == BACKBONE:
                frozen.append(module)
            else:
                carried += [
                    (f"{prefix}.{b}", getattr(module, b), group) for b in CARRIED_STATISTICS
                ]
        return carried, frozen

    def _grouped_parameters(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        index = self._group_index()
        if self._grouped is None:
            grouped = [(n, p, g) for n, p, g in index if g != BACKBONE]
            self._grouped = ({n: p for n, p, _ in grouped}, {n: g for n, _, g in grouped})
        return self._grouped

    def parameter_groups(self) -> dict[str, str]:
        """Parameter name -> group of every non-backbone parameter, in model order."""
        return dict(self._grouped_parameters()[1])

    def group_parameters(self, groups: Iterable[str]) -> dict[str, nn.Parameter]:
        """Named parameters of the given groups (and their dotted children), in model order."""
        wanted = tuple(check_group_name(g) for g in groups)
        return {
            n: p
            for n, p, g in self._group_index()
            if g != BACKBONE and in_groups(g, wanted) and isinstance(p, nn.Parameter)
        }

    def group_tensors(self, groups: Iterable[str]) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the given groups' parameters."""
        return {n: p.detach().cpu().clone() for n, p in self.group_parameters(groups).items()}

    def parameters_named(self, names: Iterable[str]) -> dict[str, nn.Parameter]:
        """The grouped parameters called ``names``, in model order, without the carried
        statistics among them (no optimizer steps those); unknown names are an error."""
        return {n: p for n, p in self._named(names).items() if isinstance(p, nn.Parameter)}

    def _named(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The grouped tensors (parameters and carried statistics) called ``names``."""
        wanted = set(names)
        found = {n: p for n, p, g in self._group_index() if g != BACKBONE and n in wanted}
        if len(found) != len(wanted):
            raise KeyError(f"no trainable parameter named {sorted(wanted - set(found))[:3]}")
        return found

    def tensors_named(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the grouped tensors called ``names`` (carried statistics
        included)."""
        return {n: p.detach().cpu().clone() for n, p in self._named(names).items()}

    def group_users(self) -> dict[str, frozenset[str]]:
        """Group -> the holdings (e.g. modality-task pairs) it serves; a group left out serves
        every holder. None here: every part serves everyone."""
        return {}

    def names_for(self, holds: Iterable[str]) -> list[str]:
        """The grouped parameter names a holder of ``holds`` owns (empty ``holds``: all)."""
        return serving(self.parameter_groups(), self.group_users(), holds)

    def trainable(self) -> TrainableTensors:
        """Every grouped tensor (detached CPU copies) with its group and the groups' users."""
        index = [(n, p, g) for n, p, g in self._group_index() if g != BACKBONE]
        tensors = {n: p.detach().cpu().clone() for n, p, _ in index}
        return TrainableTensors(tensors, {n: g for n, _, g in index}, self.group_users())

    def load_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy named tensors into grouped parameters; unknown names are an error."""
        params = self._grouped_parameters()[0]
        unknown = sorted(n for n in tensors if n not in params)
        if unknown:
            raise KeyError(f"no trainable parameter named {unknown[:3]}")
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))
                if name.endswith(".running_var") and not isinstance(params[name], nn.Parameter):
                    # A variance is >= 0; an average noised for DP may not be (post-processing
                    # keeps the guarantee, and a negative one would make the layer NaN).
                    params[name].clamp_(min=0.0)

    def train(self, mode: bool = True) -> TunedModel:
        """nn.Module's ``train``, but a BatchNorm of the frozen backbone stays in eval mode."""
        super().train(mode)
        if mode:
            self._group_index()
            for module in self._frozen_norms:
                module.eval()
        return self

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        self._index = self._grouped = None  # .to() / .half() may replace parameters
        return super()._apply(fn, recurse)


# The BatchNorm buffers that travel with the layer's weight (module docstring).
CARRIED_STATISTICS = ("running_mean", "running_var")


def _tracks_statistics(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm with affine parameters and running statistics."""
    return (
        isinstance(module, nn.modules.batchnorm._BatchNorm)
        and module.affine
        and module.track_running_stats
    )
