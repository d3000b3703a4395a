"""The parameters a client holds of a model: its components' trained and frozen parts.

In a component-wise federation (TAP's multi-task model) a client holds only the parts its
holdings use (``TunedModel.names_for``): the trainable parameters of its components, and the
frozen parameters those components sit on. Frozen parameters belong to no group, so each is
given to the module it lives in: it serves the holders of the components whose trainable
parameters share its longest dotted module prefix. ``mome.image.experts.vqa.fc1.base.weight``
sits beside ``mome.image.experts.vqa.fc1.lora_a`` (the ``vqa`` expert: its holders);
``mome.image.norm1.weight`` sits in ``mome.image`` beside the LoRA of that layer's attention and
of all its experts (the image pairs); a frozen parameter that shares no prefix with a grouped
one (a final norm) serves every holder. A model whose groups serve everyone (``group_users()``
empty, every ViT here) is held whole.

A method that keeps personal copies of the trainable parameters (TAP's X beside W~; APFL's
personal model) holds them ``1 + copies`` times, as ``fedfm_flower.study.resources`` counts storage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fedfm_flower.models.groups import TunedModel


@dataclass(frozen=True)
class Footprint:
    """Elements and bytes of the parameters a client holds, trainable and frozen apart."""

    trainable: int  # elements of the trainable parameters, every copy counted
    frozen: int  # elements of the frozen parameters
    trainable_bytes: int
    frozen_bytes: int

    @property
    def total(self) -> int:
        """Every element held."""
        return self.trainable + self.frozen

    @property
    def bytes(self) -> int:
        """Every byte held."""
        return self.trainable_bytes + self.frozen_bytes

    @property
    def trainable_fraction(self) -> float:
        """Trainable elements as a fraction of all held (0 for an empty footprint)."""
        return self.trainable / self.total if self.total else 0.0

    def with_copies(self, copies: int) -> Footprint:
        """This footprint plus ``copies`` more copies of the trainable parameters."""
        if copies < 0:
            raise ValueError(f"copies must be >= 0, not {copies}")
        return Footprint(
            self.trainable * (1 + copies),
            self.frozen,
            self.trainable_bytes * (1 + copies),
            self.frozen_bytes,
        )


def _union(users: Iterable[frozenset[str] | None]) -> frozenset[str] | None:
    """The holdings served by any of ``users`` (None: every holder)."""
    out: set[str] = set()
    for served in users:
        if served is None:
            return None
        out |= served
    return frozenset(out)


def frozen_users(model: TunedModel) -> dict[str, frozenset[str] | None]:
    """Frozen parameter name -> the holdings it serves (None: every holder), by the module
    rule of the module docstring, in model order."""
    groups = model.parameter_groups()
    users: Mapping[str, frozenset[str]] = model.group_users()
    under: dict[str, set[str]] = {}  # module path -> groups of the trainable parameters in it
    for name, group in groups.items():
        parts = name.split(".")
        for k in range(1, len(parts)):
            under.setdefault(".".join(parts[:k]), set()).add(group)
    out: dict[str, frozenset[str] | None] = {}
    for name, _ in model.named_parameters():
        if name in groups:
            continue
        parts = name.split(".")
        out[name] = None
        for k in range(len(parts) - 1, 0, -1):
            found = under.get(".".join(parts[:k]))
            if found is not None:
                out[name] = _union(users.get(g) for g in sorted(found))
                break
    return out


def held_names(model: TunedModel, holds: Iterable[str]) -> tuple[list[str], list[str]]:
    """(trainable, frozen) parameter names a holder of ``holds`` holds (empty: all)."""
    held = set(holds)
    trainable = model.names_for(held)
    frozen = [
        name
        for name, served in frozen_users(model).items()
        if not held or served is None or served & held
    ]
    return trainable, frozen


def client_footprint(model: TunedModel, holds: Iterable[str], copies: int = 0) -> Footprint:
    """The parameters a holder of ``holds`` holds of ``model``, with ``copies`` personal copies
    of its trainable ones (TAP: 1)."""
    trainable, frozen = held_names(model, holds)
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}

    def size(names: list[str]) -> tuple[int, int]:
        return (
            sum(params[n].numel() for n in names),
            sum(params[n].numel() * params[n].element_size() for n in names),
        )

    (t, t_bytes), (f, f_bytes) = size(trainable), size(frozen)
    return Footprint(t, f, t_bytes, f_bytes).with_copies(copies)
