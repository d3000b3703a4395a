"""The run's facts a strategy is built with (``PersonalizedStrategy(config, initial, context)``).

The runner gathers them before it builds the strategy (the run's name, what the task says of
every client, and the run's method resolved once:
``fedfm_flower.methods.registry.ResolvedMethod``), so no fact reaches a strategy by an attribute
write after it was built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedfm_flower.methods.registry import ResolvedMethod


@dataclass(frozen=True)
class RunContext:
    """The run's name, every client's task label and what every client holds, by client id,
    and the run's resolved method.

    ``client_tasks`` groups clients for ``sample-per-task``; ``client_holdings`` is what a
    client's data holds (the task's modality-task pairs), used when its node declares none.
    Empty mappings: the task does not name them. ``method``: the run config's method as the
    runner resolved it; None (outside a run): the strategy resolves its config's itself.
    """

    run_name: str = ""
    client_tasks: Mapping[int, str] = field(default_factory=dict)
    client_holdings: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    method: ResolvedMethod | None = None

    def __post_init__(self) -> None:
        # Read-only copies: the context is shared by the strategy's parts and never changes.
        object.__setattr__(self, "client_tasks", MappingProxyType(dict(self.client_tasks)))
        object.__setattr__(self, "client_holdings", MappingProxyType(dict(self.client_holdings)))


NO_CONTEXT = RunContext()  # a strategy built outside a run (tests, benchmarks)
