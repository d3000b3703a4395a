"""Helpers of the real-deployment tests: load scripts/deploy_local.py, check nothing is left."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def load_deploy_local() -> ModuleType:
    """scripts/deploy_local.py as a module (it is a script, not part of the package)."""
    if "deploy_local" in sys.modules:
        return sys.modules["deploy_local"]
    spec = importlib.util.spec_from_file_location(
        "deploy_local", ROOT / "scripts" / "deploy_local.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


dl = load_deploy_local()


def assert_all_gone(deployment: Any) -> None:
    """No process this deployment started (or that carries its tag) is still running."""
    started = {process.pid for process in deployment.processes}
    assert started <= deployment.seen_pids
    alive = sorted(pid for pid in deployment.seen_pids if dl.pid_alive(pid))
    # A pid could in theory be reused by an unrelated process: only ours carry the tag.
    tagged = dl._tagged_pids(deployment.tag)
    assert not tagged, f"processes of the deployment still running: {sorted(tagged)}"
    assert all(process.popen.returncode is not None for process in deployment.processes)
    assert not (set(alive) & started), f"started processes still alive: {alive}"


def read_rounds(run_dir: Path) -> list[dict[str, Any]]:
    """The per-round records of a run directory."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def hash_files(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory``, by relative path."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
