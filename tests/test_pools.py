"""The settings a sweep's driver hands to its Ray cells."""

from __future__ import annotations

from client_apps import faults
from fedfm_flower.simulation import actor_preload, fork_engine, prompt_engine
from fedfm_flower.study import pools


def test_cell_settings_are_the_variables_the_cell_reads() -> None:
    read = {
        fork_engine.ENV_SWITCH,
        prompt_engine.ENV_SWITCH,
        actor_preload.ENV_SWITCH,
        faults.ENVIRONMENT_VARIABLE,
    }
    assert set(pools.CELL_SETTINGS) == read


def test_only_the_cell_settings_that_are_set_go_with_a_task() -> None:
    environ = {"FEDFM_INJECT_FAULT": "2:hold", "FEDFM_DEPLOY_ID": "x", "PATH": "/bin"}
    assert pools.cell_environment(environ) == {"FEDFM_INJECT_FAULT": "2:hold"}
    assert pools.cell_environment({}) == {}
