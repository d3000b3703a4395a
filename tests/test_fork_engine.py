"""The fork engine: Flower's simulation backend over workers forked from one process
(``fedfm_flower.simulation.fork_engine``), against a real fork server with the ClientApps of
``tests/fork_apps.py``; its choice between itself and Ray; its guard over Flower's code."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import fork_apps
import pytest
from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict
from flwr.clientapp.client_app import ClientAppException, LoadClientAppError

from fedfm_flower.simulation import fork_engine
from fedfm_flower.simulation.fork_engine import (
    ForkBackend,
    ForkEngineError,
    app_reference,
    client_resources,
    eligible,
    slots,
)
from fedfm_flower.simulation.processes import pid_alive

ROOT = Path(__file__).resolve().parent.parent
CPU_ONLY = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}


def message(do: str = "echo", value: float = 1.0, node: int = 5, **config: str) -> Message:
    metadata = Metadata(
        run_id=1,
        message_id=f"m-{time.monotonic_ns()}",
        src_node_id=0,
        dst_node_id=node,
        reply_to_message_id="",
        group_id="",
        created_at=time.time(),
        ttl=600.0,
        message_type="train",
    )
    content = RecordDict({"config": ConfigRecord({"do": do, "value": value, **config})})
    return Message(metadata=metadata, content=content)


def context(node: int = 5) -> Context:
    return Context(
        run_id=1, node_id=node, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )


@pytest.fixture
def backend():
    built = ForkBackend({**CPU_ONLY, "init_args": {"num_cpus": 2}}, preload=("json",))
    built.build(lambda: fork_apps.app)
    yield built
    built.terminate()


def out(reply: Message) -> dict:
    return dict(reply.content["out"])


def test_slots_are_cpus_over_each_clients_as_in_rays_pool() -> None:
    assert slots({"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 6}}) == 6
    assert slots({"client_resources": {"num_cpus": 4}, "init_args": {"num_cpus": 6}}) == 1
    assert slots({"init_args": {"num_cpus": 8}}) == 4  # Flower's default: 2 CPUs a client
    with pytest.raises(ValueError, match="no ClientApp fits: 2 CPUs.*num_cpus=3"):
        slots({"client_resources": {"num_cpus": 3}, "init_args": {"num_cpus": 2}})
    with pytest.raises(ValueError, match="num_cpus must be a number, not 'one'"):
        client_resources({"client_resources": {"num_cpus": "one"}})


def test_the_fork_engine_stands_in_for_ray_only_on_the_cpu_and_a_local_cluster() -> None:
    assert eligible(CPU_ONLY, env={})
    assert eligible({}, env={"RAY_ADDRESS": "local"})  # Flower's default resources: no GPU
    assert not eligible({"client_resources": {"num_cpus": 1, "num_gpus": 0.25}}, env={})
    assert not eligible(CPU_ONLY, env={"FEDFM_SIMULATION_ENGINE": "ray"})
    assert not eligible(CPU_ONLY, env={"RAY_ADDRESS": "10.0.0.2:6379"})
    with pytest.raises(ValueError, match="FEDFM_SIMULATION_ENGINE='rey' is invalid"):
        eligible(CPU_ONLY, env={"FEDFM_SIMULATION_ENGINE": "rey"})


def test_the_engine_runs_on_a_fork_backend_where_eligible_and_on_flowers_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``run_api`` as ``start_vce`` calls it: a ``backend_fn`` closing over the parsed config."""

    def flowers_backend_fn_for(backend_config: dict):  # the shape of start_vce's closure
        def backend_fn() -> str:
            return f"ray for {backend_config}"

        return backend_fn

    class Recorded:
        size = 1
        origin = "started by the simulation"

        def __init__(self, backend_config: dict) -> None:
            self.config = backend_config

    built: list = []
    run_api = fork_engine.with_fork_backend(
        lambda app_fn, backend_fn, *rest: built.append((backend_fn(), rest))
    )
    monkeypatch.setattr(fork_engine, "ForkBackend", Recorded)
    monkeypatch.delenv("FEDFM_SIMULATION_ENGINE", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run_api(None, flowers_backend_fn_for(CPU_ONLY), "mapping", "state")
    backend, rest = built.pop()
    assert type(backend) is Recorded and backend.config == CPU_ONLY and rest == ("mapping", "state")
    gpu = {"client_resources": {"num_cpus": 1, "num_gpus": 0.5}}
    run_api(None, flowers_backend_fn_for(gpu), "mapping", "state")
    assert built.pop()[0] == f"ray for {gpu}"
    monkeypatch.setenv("FEDFM_SIMULATION_ENGINE", "ray")
    run_api(None, flowers_backend_fn_for(CPU_ONLY), "mapping", "state")
    assert built.pop()[0] == f"ray for {CPU_ONLY}"


def test_the_app_travels_by_name() -> None:
    assert app_reference(fork_apps.app) == ("fork_apps", "app")
    with pytest.raises(ForkEngineError, match="no loaded module holds the ClientApp"):
        app_reference(object())


def test_a_worker_runs_the_clientapp_with_the_clients_threads_and_no_gpu(backend) -> None:
    assert backend.num_workers == 2 and backend.is_worker_idle()
    first_context = context()
    reply, updated = backend.process_message(message(value=1.5), first_context)
    assert reply.metadata.reply_to_message_id != "" and out(reply)["value"] == 3.0
    assert out(reply)["omp"] == "1" and out(reply)["cuda"] == ""
    assert out(reply)["pid"] != os.getpid()
    assert updated.state["seen"]["n"] == 1  # the context comes back with the app's changes
    again, _ = backend.process_message(message(), updated)
    assert out(again)["calls"] == 2


def test_two_slots_run_two_messages_at_once(backend, tmp_path: Path) -> None:
    markers = [str(tmp_path / "a"), str(tmp_path / "b")]
    replies: list[Message] = []
    threads = [
        threading.Thread(
            target=lambda m=m: replies.append(
                backend.process_message(message("wait", marker=m), context())[0]
            )
        )
        for m in markers
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while not all(os.path.exists(m + ".started") for m in markers):
        assert time.monotonic() < deadline, "both messages did not run at once"
        time.sleep(0.02)
    assert not backend.is_worker_idle()  # both slots busy
    for m in markers:
        Path(m + ".go").touch()
    for thread in threads:
        thread.join(60)
    assert len({out(r)["pid"] for r in replies}) == 2
    assert backend.is_worker_idle()


def test_a_raising_clientapp_fails_its_message_and_the_worker_serves_on(backend) -> None:
    reply, _ = backend.process_message(message(), context())
    with pytest.raises(ClientAppException, match="ValueError: asked to fail"):
        backend.process_message(message("raise"), context())
    after, _ = backend.process_message(message(), context())
    assert out(after)["pid"] in {out(reply)["pid"], *(w.process.pid for w in backend.workers)}


def test_a_worker_that_dies_fails_its_message_and_is_forked_again(backend) -> None:
    for _ in range(2):  # both slots hold a worker
        backend.process_message(message(), context())
    before = {w.process.pid for w in backend.workers}
    with pytest.raises(ClientAppException, match="ended \\(exit status 7\\)"):
        backend.process_message(message("die"), context())
    pids = set()
    for _ in range(2):
        reply, _ = backend.process_message(message(), context())
        pids.add(out(reply)["pid"])
    assert len(backend.workers) == 2 and len(before & {w.process.pid for w in backend.workers}) == 1


def test_an_app_that_cannot_be_loaded_fails_each_message_as_a_load_error() -> None:
    broken = ForkBackend({**CPU_ONLY, "init_args": {"num_cpus": 1}}, preload=("json",))
    try:
        broken.build(lambda: fork_apps.app)
        broken.app = ("fork_apps", "no_such_app")
        for _ in range(2):
            with pytest.raises(LoadClientAppError, match="no_such_app"):
                broken.process_message(message(), context())
        assert broken.is_worker_idle()
    finally:
        broken.terminate()


def test_terminate_leaves_no_process(tmp_path: Path) -> None:
    built = ForkBackend({**CPU_ONLY, "init_args": {"num_cpus": 2}}, preload=("json",))
    built.build(lambda: fork_apps.app)
    pids = {out(built.process_message(message(), context())[0])["pid"]}
    server = built.server.process.pid
    built.terminate()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in (*pids, server)):
        assert time.monotonic() < deadline, "a worker or the fork server outlived terminate"
        time.sleep(0.05)
    assert not built.server.directory.exists()


def test_the_fork_server_stops_with_the_process_that_started_it(tmp_path: Path) -> None:
    script = (
        "import sys; from fedfm_flower.simulation.fork_engine import ForkServerProcess\n"
        "s = ForkServerProcess(dict(__import__('os').environ), preload=('json',))\n"
        "s.wait_ready(); print(s.process.pid, flush=True)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    server = int(result.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while pid_alive(server):
        assert time.monotonic() < deadline, "the fork server outlived its parent"
        time.sleep(0.05)


def test_install_wraps_the_engines_run_only_and_leaves_flowers_ray_backend() -> None:
    script = (
        "import flwr.server.superlink.fleet.vce.vce_api as engine\n"
        "import flwr.server.superlink.fleet.vce.backend.raybackend as backends\n"
        "flowers, run_api = backends.RayBackend, engine.run_api\n"
        "import client_apps.app\n"
        "print(backends.RayBackend is flowers, engine.run_api is not run_api,\n"
        "      getattr(engine.run_api, '__wrapped__', None) is run_api)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "FEDFM_SIMULATION_ENGINE"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "True", "True"]
    ray = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**env, "FEDFM_SIMULATION_ENGINE": "ray"},
        capture_output=True,
        text=True,
    )
    assert ray.stdout.split() == ["True", "False", "False"]


def test_install_leaves_ray_over_another_start_vce_or_run_api(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import flwr.server.superlink.fleet.vce.vce_api as flowers

    def start_vce() -> None:  # not Flower's
        return None

    run_api = getattr(flowers.run_api, "__wrapped__", flowers.run_api)
    engine = type(sys)("engine")
    engine.start_vce, engine.run_api = start_vce, run_api
    monkeypatch.setitem(sys.modules, fork_engine.ENGINE_MODULE, engine)
    monkeypatch.delenv("FEDFM_SIMULATION_ENGINE", raising=False)
    assert fork_engine.install() is False and engine.run_api is run_api
    assert "start_vce is not the code this project knows; the simulation runs on Ray" in (
        capsys.readouterr().err
    )
    engine.start_vce = lambda: None  # no source at all
    assert fork_engine.install() is False
    engine.start_vce = flowers.start_vce
    assert fork_engine.install() is True and engine.run_api.__wrapped__ is run_api


def test_a_launchers_fork_server_is_used_while_it_runs_and_left_running(tmp_path: Path) -> None:
    server = fork_engine.ForkServerProcess(dict(os.environ), preload=("json",))
    try:
        server.wait_ready()
        env = {fork_engine.SERVER_VAR: server.variable()}
        shared = fork_engine.SharedForkServer.from_environment(env)
        assert shared is not None and shared.socket_path == server.socket_path
        os.environ[fork_engine.SERVER_VAR] = server.variable()
        try:
            built = ForkBackend({**CPU_ONLY, "init_args": {"num_cpus": 1}}, preload=("json",))
        finally:
            del os.environ[fork_engine.SERVER_VAR]
        assert built.origin == "started by the launcher"
        built.build(lambda: fork_apps.app)
        worker_pid = out(built.process_message(message(), context())[0])["pid"]
        assert Path(f"/proc/{worker_pid}/stat").read_text().split()[3] == str(server.process.pid)
        built.terminate()
        assert server.process.poll() is None  # the launcher's to stop
    finally:
        server.stop()
    assert fork_engine.SharedForkServer.from_environment(env) is None  # gone: not used
    for malformed in ("", "12", "x:/tmp/s", ":/tmp/s"):
        assert (
            fork_engine.SharedForkServer.from_environment(
                {"X": "1"} | {fork_engine.SERVER_VAR: malformed}
            )
            is None
        )


def test_waiting_for_a_launchers_server_that_died_fails_naming_it(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shared = fork_engine.SharedForkServer(dead.pid, tmp_path / "never.sock")
    with pytest.raises(ForkEngineError, match=f"fork server \\(pid {dead.pid}\\) ended"):
        shared.wait_ready(timeout=5)


def test_the_launcher_starts_a_server_only_for_a_run_on_forked_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[tuple] = []
    monkeypatch.setattr(
        fork_engine, "ForkServerProcess", lambda env, preload: started.append(preload)
    )
    assert fork_engine.launch_server({}, 1, 0.25) is None  # GPU shares: Ray
    assert fork_engine.launch_server({"FEDFM_SIMULATION_ENGINE": "ray"}, 1, 0.0) is None
    assert started == []
    fork_engine.launch_server({}, 1, 0.0)
    assert started == [(*fork_engine.LIBRARIES, fork_engine.WORKER_MODULE)]
    assert not any(
        name.startswith(("client_apps", "fedfm_flower.")) for name in fork_engine.LIBRARIES
    )


def test_frames_carry_large_values_whole_and_a_cut_frame_is_a_closed_channel() -> None:
    import socket

    import numpy as np

    from fedfm_flower.simulation.fork_worker import ChannelClosed, receive_frame, send_frame

    ours, theirs = socket.socketpair()
    big = np.arange(6_000_000, dtype=np.float64)  # 48 MB, more than a socket buffer holds
    sender = threading.Thread(target=send_frame, args=(ours, ("run", big)))
    sender.start()
    kind, received = receive_frame(theirs)
    sender.join()
    assert kind == "run" and np.array_equal(received, big)
    ours.sendall((1000).to_bytes(8, "big") + b"only part")
    ours.close()
    with pytest.raises(ChannelClosed, match="991 of 1000 bytes to come"):
        receive_frame(theirs)
    theirs.close()


def test_a_worker_that_dies_loading_the_app_fails_the_message_naming_its_exit_status() -> None:
    broken = ForkBackend({**CPU_ONLY, "init_args": {"num_cpus": 1}}, preload=("json",))
    try:
        broken.build(lambda: fork_apps.app)
        broken.app = ("fork_apps_exiting", "app")
        with pytest.raises(ForkEngineError, match="ended before it loaded the ClientApp.*status 3"):
            broken.process_message(message(), context())
        assert broken.is_worker_idle() and not broken.workers
    finally:
        broken.terminate()
