"""Named parameter groups, declared by patterns where the parameters are defined.

Every trainable part of a model declares the names of its parameters with a regular expression
and the group they belong to: the LoRA tuner declares ``adapter`` for ``.lora_A.default.`` and
``.lora_B.default.`` weights, the classification head ``head`` for ``^head\\.``. Group names
are open and dotted: ``adapter``, ``adapter.global``, ``adapter.local``, ``prompt``, ``head``,
``encoder.image``, ``expert.3``. Asking for a group also selects its dotted children
(``adapter`` selects ``adapter.global`` and ``adapter.local``). A parameter no pattern claims is
backbone: frozen and never sent anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

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


@dataclass(frozen=True)
class TrainableTensors:
    """A model's trainable tensors in model order, with the group of each."""

    tensors: Mapping[str, torch.Tensor]
    groups: Mapping[str, str]

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
        self._index: list[tuple[str, nn.Parameter, str]] | None = None

    def _group_index(self) -> list[tuple[str, nn.Parameter, str]]:
        if self._index is None:
            # Walking every module for named_parameters() cost ~1 ms per call and a message
            # makes several calls: the (name, parameter, group) list is built once.
            self._index = [
                (n, p, group_of(n, self.group_patterns)) for n, p in self.named_parameters()
            ]
        return self._index

    def parameter_groups(self) -> dict[str, str]:
        """Parameter name -> group of every non-backbone parameter, in model order."""
        return {n: g for n, _, g in self._group_index() if g != BACKBONE}

    def group_parameters(self, groups: Iterable[str]) -> dict[str, nn.Parameter]:
        """Named parameters of the given groups (and their dotted children), in model order."""
        wanted = tuple(check_group_name(g) for g in groups)
        return {n: p for n, p, g in self._group_index() if g != BACKBONE and in_groups(g, wanted)}

    def group_tensors(self, groups: Iterable[str]) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the given groups' parameters."""
        return {n: p.detach().cpu().clone() for n, p in self.group_parameters(groups).items()}

    def trainable(self) -> TrainableTensors:
        """Every grouped tensor (detached CPU copies) with its group."""
        index = [(n, p, g) for n, p, g in self._group_index() if g != BACKBONE]
        tensors = {n: p.detach().cpu().clone() for n, p, _ in index}
        return TrainableTensors(tensors, {n: g for n, _, g in index})

    def load_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy named tensors into grouped parameters; unknown names are an error."""
        params = {n: p for n, p, g in self._group_index() if g != BACKBONE}
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise KeyError(f"no trainable parameter named {unknown[:3]}")
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        self._index = None  # .to() / .half() may replace parameters
        return super()._apply(fn, recurse)
