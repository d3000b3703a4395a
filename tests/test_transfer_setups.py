"""The declared transfer setups (``configs/transfer/<setup>/<name>.toml``): each is a valid run
for every method of its tuned table, sets no key a study chooses, and gives every client
enough examples at each of the default final data seeds (so a table's transfer runs cannot
fail on a partition after hours of trials)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedfm_flower.study.sweep import CONFIG_ROOT, cell_config, check_configs
from fedfm_flower.study.tune import DEFAULT_SEEDS, TRANSFER_ROOT, transfer_settings, val_share

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
TABLES = {  # the setup of each tuned table with transfer setups -> its committed state
    "glyphs-label-skew": "tuned16-glyphs-label-skew",
    "glyphs-feature-skew": "tuned16-glyphs-feature-skew",
    "glyphs-many-clients": "tuned16-glyphs-many-clients",
    "glyphs-whole-vit": "tuned16-fedperfix",
}


def _labels(table: str) -> list[str]:
    document = json.loads((RESULTS / table / "tuning.json").read_text())
    return [study["label"] for study in document["studies"]]


def _transfers(setup: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_ROOT / TRANSFER_ROOT / setup).glob("*.toml"))


def test_every_glyph_table_has_two_transfer_setups_and_nothing_else_is_declared() -> None:
    declared = sorted(p.name for p in (CONFIG_ROOT / TRANSFER_ROOT).iterdir())
    assert declared == sorted(TABLES)
    for setup in TABLES:
        assert len(_transfers(setup)) >= 2, setup


@pytest.mark.parametrize("setup", sorted(TABLES))
def test_a_transfer_setup_is_a_valid_run_of_every_method_and_of_enough_examples(
    setup: str, cache_dir: Path, tmp_path: Path
) -> None:
    from fedfm_flower.config.experiment import ExperimentConfig
    from fedfm_flower.data import check_client_sizes
    from fedfm_flower.study.search import method_space
    from fedfm_flower.tasks import task_of

    defaults = ExperimentConfig().to_run_config()
    for name in _transfers(setup):
        changed = transfer_settings(setup, name)
        configs = []
        for label in _labels(TABLES[setup]):
            config = cell_config(label, setup, 0, tmp_path, changed, f"~{name}")
            assert config["setup"] == f"{setup}~{name}"
            assert not set(changed) & set(method_space({**defaults, **config})), (label, name)
            configs.append(config)
        check_configs(configs)
        for data_seed in DEFAULT_SEEDS:  # the data do not depend on the method
            config = {**configs[0], "data-seed": data_seed, "cache-dir": str(cache_dir)}
            config["val-fraction"] = val_share(0.15, config)
            run = ExperimentConfig.from_run_config({**defaults, **config})
            check_client_sizes(run, task_of(run).example_counts(run, run.num_clients))
