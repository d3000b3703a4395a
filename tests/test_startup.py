"""What a launch does before round 1: the launcher's checks load no torch, the simulation's Ray
actors preload the ClientApp's imports (``fedfm_flower.simulation.actor_preload``) only over the
Flower code they know, and a simulation starts a Ray of its own."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from fedfm_flower.simulation import actor_preload
from fedfm_flower.simulation.actor_preload import _actor_init, install, preload, with_preload
from fedfm_flower.simulation.processes import flower_environment

ROOT = Path(__file__).resolve().parent.parent


class FakeBackend:
    """What ``with_preload`` reads and writes of Flower's RayBackend."""

    def __init__(self, actor_kwargs: dict) -> None:
        self.actor_kwargs = actor_kwargs
        self.built_with: dict | None = None

    def build(self, app_fn) -> None:  # noqa: ANN001 - Flower's signature
        self.built_with = dict(self.actor_kwargs)


def test_actors_are_built_with_the_preload_unless_the_backend_set_an_init() -> None:
    build = with_preload(FakeBackend.build)
    plain = FakeBackend({})
    build(plain, lambda: None)
    assert plain.built_with == {"on_actor_init_fn": _actor_init}
    own = object()
    tensorflow = FakeBackend({"on_actor_init_fn": own})
    build(tensorflow, lambda: None)
    assert tensorflow.built_with == {"on_actor_init_fn": own}  # Flower's own init is kept


def test_the_actor_init_travels_by_reference_and_skips_what_fails_to_import() -> None:
    # Ray pickles the actor's arguments: by reference, the actor imports this module itself
    assert len(pickle.dumps(_actor_init)) < 200 and pickle.loads(pickle.dumps(_actor_init)) is (
        _actor_init
    )
    seconds = preload(("json", "fedfm_flower.no_such_module", "fedfm_flower.simulation.waits"))
    assert set(seconds) == {"json", "fedfm_flower.simulation.waits"}
    assert all(s >= 0 for s in seconds.values())


def test_install_wraps_only_the_known_flower_code_in_the_simulation_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    raybackend = pytest.importorskip(actor_preload.BACKEND_MODULE)
    flowers = raybackend.RayBackend.build
    flowers = getattr(flowers, "__wrapped__", flowers)  # this process may have it in already
    monkeypatch.setattr(raybackend.RayBackend, "build", flowers)
    monkeypatch.delitem(sys.modules, actor_preload.ENGINE_MODULE, raising=False)
    assert not install()  # not the simulation process: nothing to do
    assert raybackend.RayBackend.build is flowers
    monkeypatch.setitem(sys.modules, actor_preload.ENGINE_MODULE, object())
    monkeypatch.setenv(actor_preload.ENV_SWITCH, "0")
    assert not install()  # switched off
    monkeypatch.delenv(actor_preload.ENV_SWITCH)
    monkeypatch.setattr(
        actor_preload, "FLOWER_SOURCES", {k: set() for k in actor_preload.FLOWER_SOURCES}
    )
    assert not install()  # code it does not know: Flower's stays, with a warning
    assert raybackend.RayBackend.build is flowers
    assert "the actors import on their first message" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr(raybackend.RayBackend, "build", flowers)
    monkeypatch.setitem(sys.modules, actor_preload.ENGINE_MODULE, object())
    assert install()
    assert raybackend.RayBackend.build.__wrapped__ is flowers
    wrapped = raybackend.RayBackend.build
    assert install() and raybackend.RayBackend.build is wrapped  # twice: wrapped once


def test_a_simulation_starts_its_own_ray_unless_ray_address_names_one() -> None:
    # ray.init() without an address would join /tmp/ray/ray_current_cluster's cluster
    assert flower_environment(Path("/tmp/home"), base={})["RAY_ADDRESS"] == "local"
    chosen = flower_environment(Path("/tmp/home"), base={"RAY_ADDRESS": "10.0.0.1:6379"})
    assert chosen["RAY_ADDRESS"] == "10.0.0.1:6379"


def test_flower_and_ray_report_no_usage_unless_the_caller_asks() -> None:
    quiet = flower_environment(Path("/tmp/home"), base={})
    assert quiet["FLWR_TELEMETRY_ENABLED"] == "0" and quiet["RAY_USAGE_STATS_ENABLED"] == "0"
    asked = {"FLWR_TELEMETRY_ENABLED": "1", "RAY_USAGE_STATS_ENABLED": "1"}
    chosen = flower_environment(Path("/tmp/home"), base=asked)
    assert chosen["FLWR_TELEMETRY_ENABLED"] == "1" and chosen["RAY_USAGE_STATS_ENABLED"] == "1"


def test_a_simulations_ray_starts_no_idle_workers_unless_asked() -> None:
    quiet = flower_environment(Path("/tmp/home"), base={})
    assert quiet["RAY_enable_worker_prestart"] == "0"
    assert quiet["RAY_prestart_worker_first_driver"] == "0"
    chosen = flower_environment(Path("/tmp/home"), base={"RAY_enable_worker_prestart": "1"})
    assert chosen["RAY_enable_worker_prestart"] == "1"


@pytest.mark.parametrize("dataset", ["digits", "digits-domains"])
def test_the_launchers_checks_load_no_torch(dataset: str, tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from fedfm_flower.simulation.launcher import preflight\n"
        f"checked = preflight(Path({str(ROOT)!r}), ['-c', \"dataset='{dataset}' "
        f"output-dir='{tmp_path}'\"], 10)\n"
        "print(json.dumps({'notes': checked.notes, 'torch': 'torch' in sys.modules}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["notes"][0].startswith("10 clients; the smallest holds")
    assert not found["torch"]


def test_the_startup_bench_stamps_each_phase_once_in_order() -> None:
    from bench.startup import stamped_run

    lines = [
        "[check] 10 clients",
        "Successfully started run 7",
        "INFO :      Starting Flower Simulation",
        "INFO fedfm_flower: run main-s0: method pfedseq, 4 rounds",
        "[round   1/4] acc n/a",
        "[round   1/4] again",
    ]
    script = "import time\n" + "".join(
        f"print({line!r}, flush=True); time.sleep(0.05)\n" for line in lines
    )
    marks, exit_s, code = stamped_run([sys.executable, "-c", script], dict(os.environ))
    assert code == 0
    order = ["checked", "run-submitted", "simulation-started", "server-ready", "round-1-done"]
    assert list(marks) == order
    assert all(marks[a] <= marks[b] for a, b in zip(order, order[1:], strict=False))
    assert marks["round-1-done"] <= exit_s


def test_the_startup_bench_counts_cpu_by_role_when_round_1_ends(tmp_path: Path) -> None:
    from bench.startup import TAG, RoleCpu, stamped_run, startup_role

    assert startup_role("/v/bin/python /v/bin/flwr run /x --stream") == "flwr cli"
    assert startup_role("/v/bin/python /v/bin/flwr-simulation --token t") == (
        "simulation (serverapp)"
    )
    assert startup_role("ray::ClientAppActor.__init__") == "ray workers"
    assert startup_role("/v/python /v/ray/_private/workers/default_worker.py --x") == "ray workers"
    assert startup_role("ray::DashboardAgent") == "ray"
    forked = "/v/python -m fedfm_flower.deploy.forkserver --socket /tmp/f/fork.sock --target x"
    assert startup_role(forked) == "fork server and workers"
    assert startup_role("/v/site-packages/ray/core/src/ray/raylet/raylet --x") == "ray"
    server = tmp_path / "flwr-simulation"  # its command line names the simulation's role
    server.write_text(
        "import time\n"
        "end = time.process_time() + 0.4\n"
        "while time.process_time() < end:\n"
        "    pass\n"
        "print('[round   1/4] acc n/a', flush=True)\n"
        "time.sleep(0.5)\n"
    )
    cpu = RoleCpu("t-" + tmp_path.name)
    env = {**os.environ, TAG: cpu.tag}
    marks, _, code = stamped_run([sys.executable, str(server)], env, cpu)
    cpu.stop()
    assert code == 0 and "round-1-done" in marks
    assert 0.35 <= cpu.at_round_1["simulation (serverapp)"] <= cpu.at_round_1["total"]
    assert cpu.by_role()["simulation (serverapp)"] >= cpu.at_round_1["simulation (serverapp)"]
