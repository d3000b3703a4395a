"""Shared fixtures: offline environment, one foundation-model cache per test session."""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

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
