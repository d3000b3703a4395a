"""The search spaces against the committed 16-trial tables (``bench/results/tuned16-*``): every
study's space, resolved on its setup as tuning resolves it, holds the space it was tuned over
(same kind and scale, so Optuna continues the study with its trials) and every trial it ran,
and no choice sits at an end of its space unless that end is the key's stated limit (issue 77:
a choice at an end asks for a wider space)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from fedfm_flower.methods.registry import METHODS
from fedfm_flower.report.tuning import EDGE_SHARE
from fedfm_flower.study import search
from fedfm_flower.study.search import describe, edge_limit, resolve_space, space_position
from fedfm_flower.study.sweep import cell_config

ROOT = Path(__file__).resolve().parent.parent
TABLES = (
    "glyphs-feature-skew",
    "glyphs-label-skew",
    "glyphs-many-clients",
    "fedperfix",
    "feddpa",
    "tap",
)
_DESCRIBED = re.compile(r"^(log-)?(int|uniform) \[([^,\]]+), ([^\]]+)\]$")


def _studies(table: str) -> tuple[int, list[dict[str, Any]]]:
    document = json.loads((ROOT / "bench/results" / f"tuned16-{table}" / "tuning.json").read_text())
    return document["tuning-seed"], [s for s in document["studies"] if not s.get("values-of")]


def _resolved(study: dict[str, Any], seed: int, tmp: Path) -> dict[str, Any]:
    """The study's space as ``tune`` resolves it: its label's run config on its setup, on
    validation data (``tune.tuning_base``)."""
    base = cell_config(study["label"], study["setup"], seed, tmp)
    base.update({"evaluation-split": "val", "val-fraction": study["val-fraction"]})
    return resolve_space(search.method_space(base), base)


def _parsed(description: str) -> tuple[str, float, float]:
    match = _DESCRIBED.match(description)
    assert match is not None, description
    return (match.group(1) or "") + match.group(2), float(match.group(3)), float(match.group(4))


def _edge(value: Any, description: str) -> str | None:
    """The end of the range ``description`` that ``value`` lies at (the report's rule), or None."""
    at = space_position(value, description)
    if at is None or EDGE_SHARE < at < 1 - EDGE_SHARE:
        return None
    if at <= EDGE_SHARE and isinstance(value, int) and value <= 1:
        return None  # a count at 1 has nothing below it
    return "bottom" if at <= EDGE_SHARE else "top"


@pytest.mark.parametrize("table", TABLES)
def test_each_studys_space_holds_the_space_and_the_trials_it_was_tuned_over(
    table: str, tmp_path: Path
) -> None:
    """Resolving validates every new end against the setup's run config; each committed range
    keeps its kind and scale (Optuna refuses another on a study with trials) and lies inside
    the new one; every trial that ran drew values the new space can give."""
    seed, studies = _studies(table)
    assert studies
    for study in studies:
        space = _resolved(study, seed, tmp_path)
        assert set(space) == set(study["space"]), study["study"]
        for key, rng in space.items():
            old, new = study["space"][key], describe(rng)
            if old == new:
                continue
            (old_kind, old_lo, old_hi), (new_kind, new_lo, new_hi) = _parsed(old), _parsed(new)
            assert old_kind == new_kind, (study["study"], key, old, new)
            assert new_lo <= old_lo and old_hi <= new_hi, (study["study"], key, old, new)
        for trial in study["trials"]:
            for key, value in trial["values"].items():
                assert space[key].contains(value), (study["study"], trial["number"], key, value)


@pytest.mark.parametrize("table", TABLES)
def test_no_choice_sits_at_an_end_of_its_space_but_at_a_stated_limit(
    table: str, tmp_path: Path
) -> None:
    """A one-draw table's choice (made before choosing over seeds) that the report flags at an
    end of the space its study searched lies inside the current space by more than the
    report's margin (on the range's scale), unless that end is the key's stated limit. A study
    continued in the widened space (its ``selection`` recorded) is judged by its report's
    edge flags instead: its state is committed while it runs, and a choice there at a new end
    asks for a wider range, not for a broken build."""
    seed, studies = _studies(table)
    for study in studies:
        if study.get("chosen") is None or study.get("selection") is not None:
            continue
        space = _resolved(study, seed, tmp_path)
        for key, value in study["chosen"]["values"].items():
            end = _edge(value, study["space"][key])
            if end is None or edge_limit(study["label"], key, end):
                continue
            at = space_position(value, describe(space[key]))
            assert at is not None and EDGE_SHARE < at < 1 - EDGE_SHARE, (
                f"{study['study']}: `{key}` = {value} at the {end} of {study['space'][key]}, "
                f"at {at} of {describe(space[key])}"
            )


def test_widened_training_ranges_keep_their_kind_and_the_old_ranges_inside() -> None:
    """lr: 30x each way of the setup's (was 10x); epochs 1-5 (was 1-3, an int); steps half to
    4x the setup's (was x/÷ 2, a log int)."""
    base = {"method": "fedavg", "dataset": "digits", "lr": 0.01, "local-epochs": 1}
    space = resolve_space(search.training_space(base), base)
    assert space["lr"].log and space["lr"].lo == pytest.approx(0.01 / 30)
    assert space["lr"].hi == pytest.approx(0.3)
    assert space["local-epochs"] == search.IntRange(1, 5)
    steps = {**base, "local-steps": 10}
    assert resolve_space(search.training_space(steps), steps)["local-steps"] == search.IntRange(
        5, 40, log=True
    )


def test_a_stated_limit_names_its_end_and_only_that_end() -> None:
    """APFL's mixing weight is bounded by 0 and 1 (both ends stated); the common keys have no
    limit; a variant label reads its method's limits; an end is bottom or top."""
    assert "0 evaluates the shared model" in str(edge_limit("apfl", "apfl-alpha", "bottom"))
    assert "1 evaluates the personal model" in str(edge_limit("apfl", "apfl-alpha", "top"))
    assert edge_limit("fedavg", "apfl-alpha", "top") is None  # another method's key
    for end in search.EDGES:
        assert edge_limit("apfl", "lr", end) is None
        assert edge_limit("feddpa-t:fixed", "feddpa-alpha", end) is None
    with pytest.raises(ValueError, match="one of bottom, top, got 'high'"):
        edge_limit("apfl", "apfl-alpha", "high")


def test_every_stated_limit_is_an_end_of_a_searched_key() -> None:
    """A method's limits name keys of its own search (or the common ones) and a real end."""
    common = {"lr", "local-epochs", "local-steps"}
    for method, spec in METHODS.items():
        for key, end in {**search.TRAINING_LIMITS, **spec.search_limits}:
            assert key in set(spec.search) | common, (method, key)
            assert end in search.EDGES, (method, key, end)
