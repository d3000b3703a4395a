"""The directories a user provides (the authors' data of a paper's setting), never in the
repository: where a config names one that is not here, an existing directory stands in for it
(preflight still refuses the missing one: tests/test_paper_tables.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

USER_DIRS = ("data-dir", "unseen-test-dir")


def with_user_dirs(values: dict[str, Any], stand_in: Path) -> dict[str, Any]:
    """``values`` with each user directory that does not exist replaced by ``stand_in``."""
    missing = [k for k in USER_DIRS if values.get(k) and not Path(values[k]).exists()]
    return {**values, **dict.fromkeys(missing, str(stand_in))}
