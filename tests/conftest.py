"""Shared fixtures: offline environment, one foundation-model cache per test session."""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
# No network at run time: Flower's telemetry and Ray's usage stats would post from every run.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Configs without a cache-dir cache under $XDG_CACHE_HOME: keep the tests' out of the user's.
os.environ["XDG_CACHE_HOME"] = _XDG_CACHE = tempfile.mkdtemp(prefix="fedfm-test-xdg-")
_XDG_OWNER = os.getpid()


def _remove_xdg_cache() -> None:
    """Remove the session's XDG cache; forked children that exit through atexit leave it."""
    if os.getpid() == _XDG_OWNER:
        shutil.rmtree(_XDG_CACHE, ignore_errors=True)


atexit.register(_remove_xdg_cache)


# The modules whose tests start real processes (a SuperLink and SuperNodes, Ray, forked
# workers, Flower's CLI) and wait on them. Under pytest-xdist (scripts/test.sh runs 2 workers)
# they are one unit of work, run one after another by one worker, so no two of them compete for
# the cores while the other worker takes the in-process tests, one at a time as it frees up.
PROCESS_MODULES = frozenset(
    {
        "test_bench",
        "test_chaos",
        "test_deploy_superlink",
        "test_deploy_supernode",
        "test_deployment",
        "test_failures",
        "test_faults",
        "test_fork_engine",
        "test_forkserver",
        "test_large_messages",
        "test_ray_cells",
        "test_secagg",
        "test_simulation",
        "test_startup",
        "test_warm_executor",
        "test_warm_worker",
    }
)


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: ``processes`` for ``PROCESS_MODULES``, else the test."""
    module = nodeid.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")
    return "processes" if module in PROCESS_MODULES else nodeid


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a plain run lacks
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with ``work_unit`` as the scope."""
    from xdist.scheduler import LoadScopeScheduling

    class ProcessesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ProcessesTogether(config, log)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory shared by the whole session (the foundation model is built once)."""
    shared = os.environ.get("FEDFM_TEST_CACHE_DIR")
    if shared:
        return Path(shared)
    return tmp_path_factory.mktemp("fedfm-cache")


@pytest.fixture
def small_run_config(cache_dir: Path, tmp_path: Path) -> dict:
    """A small, fast experiment: 4 clients, 2 rounds, tiny ViT on offline digits."""
    return {
        "num-server-rounds": 2,
        "num-clients": 4,
        "cache-dir": str(cache_dir),
        "output-dir": str(tmp_path / "runs"),
        "pretrain-epochs": 30,
        "seed": 0,
    }


@pytest.fixture
def multitask_run_config(small_run_config: dict, tmp_path: Path) -> dict:
    """TAP's multi-task federation in small: 4 clients (pair groups {0,1}, {2}, {3}), 2 rounds,
    mm-offline at 32 px; add the method."""
    return {
        **small_run_config,
        "dataset": "multitask",
        "backbone": "mm-offline",
        "image-size": 32,
        "pretrain-epochs": 2,
        "lora-rank": 4,
        "optimizer": "adamw",
        "lr": 0.001,
        "batch-size": 16,
        "max-new-tokens": 4,
        "local-steps": 2,
        "eval-every": 5,  # the last round evaluates anyway
        "client-state-dir": str(tmp_path / "state"),
    }


@pytest.fixture
def flowerless_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``sys.executable`` in a directory without Flower's commands and PATH of one empty
    directory, which is returned (as after ``pip install --target``: put a fake ``flwr`` there)."""
    interpreter = tmp_path / "python" / "bin"
    interpreter.mkdir(parents=True)
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    monkeypatch.setattr(sys, "executable", str(interpreter / "python3"))
    monkeypatch.setenv("PATH", str(scripts))
    return scripts


@pytest.fixture
def flowers_link_states(monkeypatch: pytest.MonkeyPatch) -> dict[str, type]:
    """Flower's LinkState classes (in memory and SQLite) with Flower's own ``activate_node`` and
    ``get_message_res``, restored after the test whatever it installs on them."""
    from fedfm_flower.deploy.restarted_nodes import STATE_CLASSES

    classes = {}
    for module, name in STATE_CLASSES.items():
        cls = getattr(importlib.import_module(module), name)
        for method in ("activate_node", "get_message_res"):
            function = getattr(cls, method)
            monkeypatch.setattr(cls, method, getattr(function, "__wrapped__", function))
        classes[name] = cls
    return classes
