"""The warm executors' fork server: one process imports once, forks one SuperExec per node.

A real server (``python -m fedfm_flower.deploy.forkserver``) in a subprocess, with a stand-in
target module written here: a child reports what it was given and whether the preloaded module
came from the server's import.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fedfm_flower.deploy import forkserver
from fedfm_flower.deploy import supernode as launcher
from fedfm_flower.simulation.processes import pid_alive

TARGET = textwrap.dedent(
    """
    import json, os, sys, time
    import heavy

    def main(argv):
        if argv[0] == "sleep":
            time.sleep(60)
        print(json.dumps({
            "argv": argv,
            "pid": os.getpid(),
            "cwd": os.getcwd(),
            "marker": os.environ.get("FORK_TEST_MARKER"),
            "server-var": os.environ.get("SERVER_ONLY"),
            "heavy-imported-by": heavy.IMPORTED_BY,
        }), flush=True)
        return int(argv[1])
    """
)


@pytest.fixture
def server(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "heavy.py").write_text("import os\nIMPORTED_BY = os.getpid()\n")
    (tmp_path / "lib" / "fork_target.py").write_text(TARGET)
    socket_path = tmp_path / "fork.sock"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib"), "SERVER_ONLY": "yes"}
    command = [sys.executable, "-m", "fedfm_flower.deploy.forkserver", "--socket"]
    command += [str(socket_path), "--preload", "heavy", "--target", "fork_target"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not socket_path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the fork server did not listen"
        time.sleep(0.05)
    yield process, socket_path
    if process.poll() is None:
        process.kill()
    process.communicate()


def fork(socket_path: Path, argv: list[str], tmp_path: Path, name: str):
    """A child with its stdout in ``tmp_path / name``; the child and that file."""
    out = tmp_path / name
    with open(out, "wb") as stdout, open(os.devnull, "rb") as stdin:
        env = {**os.environ, "FORK_TEST_MARKER": name}
        stdio = (stdin.fileno(), stdout.fileno(), 2)
        child = forkserver.request_fork(socket_path, argv, env=env, cwd=str(tmp_path), stdio=stdio)
    return child, out


def gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_child_runs_with_the_requesters_arguments_environment_and_stdio(server, tmp_path):
    process, socket_path = server
    first, out_a = fork(socket_path, ["run", "7"], tmp_path, "a")
    second, out_b = fork(socket_path, ["run", "0"], tmp_path, "b")
    assert first.wait() == 7 and second.wait() == 0
    reports = [json.loads(out.read_text()) for out in (out_a, out_b)]
    assert [r["argv"] for r in reports] == [["run", "7"], ["run", "0"]]
    assert [r["pid"] for r in reports] == [first.pid, second.pid]
    assert [r["marker"] for r in reports] == ["a", "b"]  # its own environment ...
    assert all(r["server-var"] is None for r in reports)  # ... not the server's
    assert all(r["cwd"] == str(tmp_path) for r in reports)
    # the module was imported once, by the server, before either fork
    assert {r["heavy-imported-by"] for r in reports} == {process.pid}
    assert process.poll() is None  # the server serves on


def test_a_child_dies_with_its_requester_and_a_signal_is_reported(server, tmp_path):
    _, socket_path = server
    child, _ = fork(socket_path, ["sleep", "0"], tmp_path, "sleeper")
    assert pid_alive(child.pid) and child.poll() is None
    child.connection.close()  # what a SuperNode's death does to its end
    assert gone(child.pid, within=5.0)
    other, _ = fork(socket_path, ["sleep", "0"], tmp_path, "other")
    os.kill(other.pid, signal.SIGTERM)
    assert other.wait() == -signal.SIGTERM
    assert other.poll() == -signal.SIGTERM


def test_a_bad_request_is_refused_and_the_server_serves_on(server, tmp_path):
    import socket

    process, socket_path = server
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(str(socket_path))
    payload = b"not json"
    descriptors = len(os.listdir(f"/proc/{process.pid}/fd"))
    socket.send_fds(connection, [forkserver.HEADER.pack(len(payload)) + payload], [0, 1, 2])
    assert forkserver._read_line(connection) == "0"
    connection.close()
    time.sleep(0.3)  # the server closes its end of the refused connection
    assert len(os.listdir(f"/proc/{process.pid}/fd")) <= descriptors  # none of the 3 kept
    for bad in ({"argv": "run", "env": {}, "cwd": "/"}, {"argv": [], "env": {"A": 1}, "cwd": "/"}):
        with pytest.raises(ValueError, match="argv|env"):
            forkserver.ForkRequest.decode(json.dumps(bad).encode())
    child, _ = fork(socket_path, ["run", "3"], tmp_path, "after")
    assert child.wait() == 3
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0
    assert not socket_path.exists()


def test_the_server_stops_its_children_when_it_stops(server, tmp_path):
    process, socket_path = server
    child, _ = fork(socket_path, ["sleep", "0"], tmp_path, "sleeper")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 0
    assert child.wait() == -signal.SIGTERM
    assert not pid_alive(child.pid)


def test_the_keeper_forks_when_a_server_is_named_and_falls_back_when_it_is_gone(
    monkeypatch, tmp_path, capsys
):
    requests: list[tuple] = []
    monkeypatch.setattr(
        forkserver, "request_fork", lambda path, argv: requests.append((path, argv)) or "forked"
    )
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda command: ("popen", command))
    keeper = launcher.ExecutorKeeper("127.0.0.1:9111")
    monkeypatch.delenv(forkserver.FORKSERVER_VAR, raising=False)
    assert keeper.spawn()[0] == "popen"  # no server named: a process of its own
    monkeypatch.setenv(forkserver.FORKSERVER_VAR, str(tmp_path / "fork.sock"))
    assert keeper.spawn() == "forked"
    assert requests == [(str(tmp_path / "fork.sock"), keeper.command()[3:])]
    assert requests[0][1][:2] == ["--insecure", "--runtime-api-address"]

    def unreachable(path, argv):
        raise FileNotFoundError(path)

    monkeypatch.setattr(forkserver, "request_fork", unreachable)
    assert keeper.spawn() == ("popen", keeper.command())
    assert "no fork from" in capsys.readouterr().err
    keeper.failures = launcher.EXECUTOR_FAILURES  # Flower's SuperExec is never forked
    monkeypatch.setattr(forkserver, "request_fork", lambda path, argv: pytest.fail("forked"))
    assert keeper.spawn()[1][0].endswith("flower-superexec")


def test_the_deployment_starts_the_server_and_names_it_to_its_nodes(tmp_path):
    from fedfm_flower.deploy import DeployOptions, LocalDeployment

    with pytest.raises(ValueError, match="--shared-imports needs the warm executors"):
        DeployOptions(workdir=tmp_path, shared_imports=True, warm_executor=False)
    deployment = LocalDeployment(DeployOptions(workdir=tmp_path, shared_imports=True))
    assert deployment.forkserver_socket == tmp_path / "forkserver.sock"
    deep = tmp_path / ("d" * 120)
    long = LocalDeployment(DeployOptions(workdir=deep, shared_imports=True))
    assert len(os.fsencode(long.forkserver_socket)) < 100  # a Unix socket's path limit
    # there, in a directory of this user's alone: no other local user can bind it first
    private = long.forkserver_socket.parent
    assert long.forkserver_socket == long.forkserver_socket  # one directory per deployment
    assert private.stat().st_uid == os.getuid() and private.stat().st_mode & 0o777 == 0o700
    assert long.tag[:16] not in str(long.forkserver_socket)  # mkdtemp names it, not the tag
    long.stop(grace=0.1)
    assert not private.exists()
    from fedfm_flower.deploy.cli import build_parser

    assert build_parser("deploy").parse_args(["--shared-imports"]).shared_imports is True


def test_a_failed_fork_is_a_refusal_not_the_servers_end(monkeypatch, tmp_path):
    import socket

    server = forkserver.ForkServer(tmp_path / "fork.sock")
    server.listen()

    def no_memory() -> int:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(forkserver.os, "fork", no_memory)
    requester = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    requester.connect(str(tmp_path / "fork.sock"))
    request = forkserver.ForkRequest(["run"], {}, str(tmp_path))
    socket.send_fds(requester, [request.encode()], [0, 1, 2])
    server._accept()
    assert forkserver._read_line(requester) == "0"
    assert server.children == {}
    server.listener.close()


def test_a_requester_that_gave_up_loses_its_child_not_the_server(monkeypatch, tmp_path):
    """30 SuperNodes starting on 2 cores: a requester's wait ran out before its answer; the
    server's reply then failed, which ended the server (and every fork with it)."""
    import socket

    server = forkserver.ForkServer(tmp_path / "fork.sock")
    server.listen()
    stand_in = subprocess.Popen(["sleep", "60"])  # the fork, as a process we can watch
    monkeypatch.setattr(forkserver.os, "fork", lambda: stand_in.pid)
    requester = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    requester.connect(str(tmp_path / "fork.sock"))
    request = forkserver.ForkRequest(["run"], {}, str(tmp_path))
    socket.send_fds(requester, [request.encode()], [0, 1, 2])
    requester.close()  # gave up
    server._accept()  # no exception: the server serves on
    assert stand_in.wait(timeout=10) == -signal.SIGKILL
    server.listener.close()


def test_a_server_of_another_user_gets_no_request(server, tmp_path, monkeypatch):
    """The requester checks the listening process's uid (SO_PEERCRED) before it sends its
    environment and descriptors: here the server runs as this user, and this process claims
    another uid, so it is refused and the server forks nothing."""
    import socket as socket_module

    if not hasattr(socket_module, "SO_PEERCRED"):
        pytest.skip("SO_PEERCRED is Linux's")
    process, socket_path = server
    real_uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    with pytest.raises(OSError, match=f"runs as uid {real_uid}, not this user"):
        fork(socket_path, ["run", "3"], tmp_path, "refused")
    assert (tmp_path / "refused").read_text() == "" and process.poll() is None
    monkeypatch.setattr(os, "getuid", lambda: real_uid)
    child, _ = fork(socket_path, ["run", "0"], tmp_path, "served")
    assert child.wait() == 0
