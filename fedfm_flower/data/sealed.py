"""A split that must not be read: the test split of a run that evaluates on validation data.

``evaluation-split = val`` (tuning) puts a ``SealedSplit`` where a client's test split was, so
any code that touches it (its length, rows, batches or attributes) fails loudly instead of
letting test data steer a choice of hyperparameters.
"""

from __future__ import annotations

from typing import Any, NoReturn


class SealedSplitError(RuntimeError):
    """Something read a split that the run's config seals."""


class SealedSplit:
    """Stands in for a split nobody may read; every use raises ``SealedSplitError``."""

    def __init__(self, name: str, reason: str) -> None:
        object.__setattr__(self, "_what", f"the {name} split is sealed ({reason})")

    def _refuse(self, *_: Any, **__: Any) -> NoReturn:
        raise SealedSplitError(object.__getattribute__(self, "_what"))

    def __getattr__(self, name: str) -> NoReturn:
        self._refuse()

    __len__ = __iter__ = __getitem__ = __bool__ = __setattr__ = _refuse

    def __repr__(self) -> str:
        return f"SealedSplit({object.__getattribute__(self, '_what')!r})"
