"""The runs of one setup and data seed in a grid directory share one foundation model.

A sweep pairs its methods' runs of one (setup, seed); a tuning study ranks its trials against
each other and pairs its final runs with other methods'. Runs made on two foundation models
(two recipes, after a code change; two builds of one recipe, from two machines' caches:
``fedfm_flower.models.foundation_cards``) compare the models as much as the methods or values, so
``SetupFoundations`` holds the card of the first finished run of each (setup, data seed) and
refuses (``FoundationMismatch``) a run that recorded another. The sweep and the tuning
command check their directory's finished runs before they run anything, and each run as it
ends; a report checks the runs it pairs by seed (``report.tables``), with its own remedy. Runs
whose card names no offline foundation (timm or Hub weights, random) are not checked. Light: no
torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedfm_flower.config.experiment import data_seed_of
from fedfm_flower.models.foundation_cards import describe, model_difference, recorded_card


class FoundationMismatch(ValueError):
    """Two runs of one setup and data seed ran on different foundation models; the message
    names both runs and builds, and what to do."""


MOVE_OR_RESTORE = (
    "Their results are compared on one model: put the build the earlier runs used back in the "
    "cache (a tuning study with --state keeps its builds) or move the runs of one model away (a "
    "study's from --out and --state) so they run again; the finished runs are as they were"
)


class SetupFoundations:
    """The foundation model each (setup, data seed) of a set of runs share: the card of the
    first run of each, and a ``FoundationMismatch`` for a run on another, its message ending in
    ``remedy``."""

    def __init__(self, remedy: str = MOVE_OR_RESTORE) -> None:
        self.remedy = remedy
        self._first: dict[tuple[str, int], tuple[Path, dict[str, Any]]] = {}

    @classmethod
    def of_finished_runs(cls, parents: Iterable[Path]) -> SetupFoundations:
        """The foundations of the finished runs (a ``summary.json``) in the directories
        ``parents``; ``FoundationMismatch`` when two of one setup and data seed differ."""
        found = cls()
        for summary in sorted(s for parent in parents for s in parent.glob("*/summary.json")):
            found.add(summary.parent)
        return found

    def add(self, run_dir: Path) -> None:
        """Take the run at ``run_dir`` (its recorded card and run config: ``check``)."""
        card, run_config = recorded_card(run_dir)
        if "setup" in run_config:
            self.check(str(run_config["setup"]), run_data_seed(run_config), run_dir, card)

    def check(self, setup: str, seed: int, run_dir: Path, card: dict[str, Any]) -> None:
        """Take a run's card; ``FoundationMismatch`` naming both runs and models when the
        earlier runs of its setup and seed (``add``: the data seed; a report: the seed it
        pairs runs by) ran on another model. A card naming no offline foundation is not
        checked."""
        if not card.get("key"):
            return
        first, first_card = self._first.setdefault((setup, seed), (run_dir, card))
        what = model_difference(first_card, card)
        if what:
            raise FoundationMismatch(
                f"runs of setup {setup} at seed {seed} ran on {what}: {first} on "
                f"{describe(first_card)}, {run_dir} on {describe(card)}. {self.remedy}"
            )


def run_data_seed(run_config: dict[str, Any]) -> int:
    """The seed a run's data came from (``data-seed``, else ``seed``: runs made before the key
    existed too)."""

    return data_seed_of(int(run_config.get("seed", 0)), int(run_config.get("data-seed", -1)))
