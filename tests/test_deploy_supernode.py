"""The SuperNode launcher with short idle waits (``fedfm_flower.deploy.supernode``).

The loopback tests (``test_deployment.py``, ``test_faults.py``) start every SuperNode through it;
these tests pin what it changes in Flower and what it hands on.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
import threading
import time

import pytest

from fedfm_flower.deploy import DeployOptions, LocalDeployment, object_pushes, superexec
from fedfm_flower.deploy import supernode as launcher
from fedfm_flower.deploy.cli import build_parser
from fedfm_flower.deploy.known_flower import flower_version, is_known
from fedfm_flower.simulation.processes import pid_alive


@pytest.fixture
def loop(monkeypatch):
    """Flower's SuperNode loop module, its ``time`` restored after the test."""
    module = importlib.import_module(launcher.LOOP_MODULE)
    monkeypatch.setattr(module, "time", time)
    monkeypatch.setattr(module, "pull_objects", module.pull_objects)
    pull = getattr(module, launcher.PULL_AND_STORE)
    monkeypatch.setattr(module, launcher.PULL_AND_STORE, getattr(pull, "__wrapped__", pull))
    fleet = importlib.import_module(launcher.FLEET_MODULE)
    factory = getattr(fleet, launcher.RETRY_FACTORY)
    monkeypatch.setattr(fleet, launcher.RETRY_FACTORY, getattr(factory, "__wrapped__", factory))
    push = getattr(fleet, object_pushes.PUSH_FACTORY)
    monkeypatch.setattr(fleet, object_pushes.PUSH_FACTORY, getattr(push, "__wrapped__", push))
    monkeypatch.delenv(superexec.MAX_POLL_VAR, raising=False)
    registered = []  # main's exit handlers, not run at the test process's exit
    monkeypatch.setattr(launcher.atexit, "register", registered.append)
    module.registered_at_exit = registered
    return module


def test_idle_waits_grow_to_the_longest_and_a_reply_wait_starts_them_over(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    waits = launcher.ShortWaits(0.1, 1.0)
    for _ in range(8):
        waits.sleep(3)  # Flower's wait after an empty pull
    assert slept == pytest.approx([0.1, 0.15, 0.225, 0.3375, 0.50625, 0.759375, 1.0, 1.0])
    slept.clear()
    waits.sleep(0.5)  # Flower's wait for the ClientApp's reply: a message is in progress
    waits.sleep(0.5)
    waits.sleep(3)  # the next round's message follows the reply closely
    assert slept == [0.1, 0.1, 0.1]
    slept.clear()
    waits.sleep(0.05)  # never longer than Flower asked for
    assert slept == [0.05]
    assert waits.time is time.time and waits.monotonic is time.monotonic


def test_the_node_wakes_its_superexec_after_each_message_it_stored(loop, monkeypatch):
    stored = iter([None, 7, None, 7])  # the loop's pulls: empty, a message, empty, a message
    monkeypatch.setattr(loop, launcher.PULL_AND_STORE, lambda **kwargs: next(stored))
    woken: list[int] = []
    assert launcher.wake_on_stored_messages(lambda: woken.append(1)) is True
    pull = getattr(loop, launcher.PULL_AND_STORE)
    assert [pull(state=None), pull(state=None)] == [None, 7] and woken == [1]
    assert launcher.wake_on_stored_messages(lambda: woken.append(2)) is True  # no double wrap
    pull = getattr(loop, launcher.PULL_AND_STORE)
    assert [pull(state=None), pull(state=None)] == [None, 7]
    assert woken == [1, 2]
    # What it relies on: the loop calls the pull by that module name.
    source = inspect.getsource(loop.start_client_internal)
    assert f"run_id = {launcher.PULL_AND_STORE}(" in source


def test_an_unknown_flower_gets_no_wake_ups_and_says_so(loop, monkeypatch, capsys):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0")
    pull = getattr(loop, launcher.PULL_AND_STORE)
    assert launcher.wake_on_stored_messages(lambda: None) is False
    assert getattr(loop, launcher.PULL_AND_STORE) is pull
    assert "without wake-ups" in capsys.readouterr().err


def test_flowers_pull_stores_the_objects_before_it_returns(loop):
    source = inspect.getsource(getattr(loop, launcher.PULL_AND_STORE))
    puts, returned = source.index("object_store.put(obj_id"), source.rindex("return run_id")
    assert puts < returned  # a task taken on the wake finds its message's objects


def test_the_waits_it_shortens_are_flowers_sleeps_in_that_module(loop):
    # What the launcher relies on: the SuperNode loop sleeps 3 s after an empty pull and
    # 0.5 s between looks for a reply, through the module's own `time` name.
    source = inspect.getsource(loop)
    assert "time.sleep(3)" in source and "time.sleep(0.5)" in source
    assert loop.time is time


def test_shorten_waits_patches_the_loop_on_a_known_flower(loop, monkeypatch):
    from flwr.supercore.inflatable.inflatable_utils import pull_objects

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    assert loop.pull_objects is pull_objects
    assert launcher.shorten_waits(0.2, 2.0) is True
    assert loop.pull_objects.func is pull_objects  # the message objects' pulls: short pauses
    assert loop.pull_objects.keywords == {"initial_backoff": 0.2, "backoff_cap": 2.0}
    assert isinstance(loop.time, launcher.ShortWaits)
    loop.time.sleep(3)
    assert slept == [0.2]
    assert launcher.shorten_waits(0.05, 0.5) is True  # again: new intervals, no double wrap
    assert (loop.time.first, loop.time.longest, loop.time.next_idle) == (0.05, 0.5, 0.05)
    assert loop.pull_objects.func is pull_objects
    assert loop.pull_objects.keywords == {"initial_backoff": 0.05, "backoff_cap": 0.5}
    assert not isinstance(time, launcher.ShortWaits)


def test_an_unknown_flower_keeps_its_own_waits_and_says_so(loop, monkeypatch, capsys):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0")
    pulls = loop.pull_objects
    assert launcher.shorten_waits(0.1, 1.0) is False
    assert loop.time is time and loop.pull_objects is pulls
    assert "Flower 9.0.0" in capsys.readouterr().err


def _receive_during_stop(loop, pull_object):
    """Flower's SuperNode receiving one message of a run known to the node, its objects pulled
    by ``pull_object``: the node's state and object store, and what the receive returned."""
    from flwr.app import ConfigRecord, RecordDict
    from flwr.app.message.message import make_message
    from flwr.app.metadata import Metadata
    from flwr.supercore.inflatable.inflatable_object import get_object_tree
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.run import Run
    from flwr.supernode.nodestate import NodeStateFactory

    factory = NodeStateFactory(ObjectStoreFactory())
    state, store = factory.state(), factory.objectstore_factory.store()
    state.set_node_id(7)
    state.store_run(Run.create_empty(5))
    metadata = Metadata(5, "", 1, 7, "", "2", time.time(), 3600.0, "train")
    message = make_message(metadata, RecordDict({"config": ConfigRecord({"lr": 0.1})}))
    metadata.__dict__["_message_id"] = message.object_id  # as the SuperLink sets it
    tree = get_object_tree(message)
    returned = loop._pull_and_store_message(
        state, store, {}, lambda: (message, tree), None, None, pull_object,
        lambda run_id, message_id: None, None,
    )  # fmt: skip
    return state, store, message.object_id, returned


def _stopped(run_id: int, object_id: str) -> bytes:
    from flwr.supercore.run import RunNotRunningException

    raise RunNotRunningException


def test_in_flower_a_run_stopped_mid_pull_leaves_its_task_pending_with_the_message(loop):
    # What the patch mends (module doc); when Flower handles it, this fails and the patch can go.
    state, store, message_id, returned = _receive_during_stop(loop, _stopped)
    assert returned is None
    assert [task.status.status for task in state.get_tasks(run_ids=[5])] == ["pending"]
    assert [m.metadata.message_id for m in state.get_messages_legacy()] == [message_id]
    assert store.get(message_id) == b""  # preregistered, never to arrive


def test_with_the_patch_the_stopped_runs_task_fails_and_its_message_goes(loop):
    assert launcher.fail_pulls_of_stopped_runs() is True
    state, store, message_id, returned = _receive_during_stop(loop, _stopped)
    assert returned is None
    (task,) = state.get_tasks(run_ids=[5])
    assert (task.status.status, task.status.sub_status) == ("finished", "failed")
    assert "no longer running" in task.status.details
    assert state.get_messages_legacy() == [] and store.get(message_id) is None


def test_the_patch_keeps_the_pulls_result_their_errors_and_the_short_waits(loop, monkeypatch):
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError, pull_objects

    assert launcher.fail_pulls_of_stopped_runs() is True
    assert launcher.fail_pulls_of_stopped_runs() is True  # again: no second wrap
    assert loop.pull_objects.__wrapped__ is pull_objects
    assert launcher.shorten_waits(0.2, 2.0) is True  # after it: the pauses reach Flower's pull
    assert loop.pull_objects.func.__wrapped__ is pull_objects
    assert loop.pull_objects.keywords == {"initial_backoff": 0.2, "backoff_cap": 2.0}
    assert launcher.fail_pulls_of_stopped_runs() is True
    assert loop.pull_objects.func.__wrapped__ is pull_objects
    assert loop.pull_objects.keywords == {"initial_backoff": 0.2, "backoff_cap": 2.0}
    contents = {"a": b"x", "b": b"y"}
    pulled = loop.pull_objects(list(contents), pull_object_fn=contents.__getitem__)
    assert pulled == contents

    def missing(object_id: str) -> bytes:
        raise ObjectPullError(object_id, "the object could not be found.")

    with pytest.raises(ObjectPullError):
        loop.pull_objects(["a"], pull_object_fn=missing)
    with pytest.raises(launcher.RunStoppedError):
        loop.pull_objects(["a"], pull_object_fn=lambda object_id: _stopped(5, object_id))


def test_an_unknown_flower_keeps_its_pulls_and_says_so(loop, monkeypatch, capsys):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0")
    pulls = loop.pull_objects
    assert launcher.fail_pulls_of_stopped_runs() is False
    assert loop.pull_objects is pulls
    assert "Flower 9.0.0" in capsys.readouterr().err


def test_main_hands_every_other_argument_to_flower_supernode(loop, monkeypatch):
    import flwr.supernode.cli

    seen: dict[str, object] = {}

    def fake_supernode() -> None:
        seen["argv"] = list(sys.argv)
        seen["superexec-poll"] = os.environ.get(launcher.SUPEREXEC_POLL_VAR)
        seen["waits"] = (loop.time.first, loop.time.longest)
        seen["stopped-runs-fail"] = loop.pull_objects.func.fails_stopped_runs
        seen["superexec-longest-poll"] = os.environ.get(superexec.MAX_POLL_VAR)
        fleet = importlib.import_module(launcher.FLEET_MODULE)
        seen["500s-retried"] = getattr(fleet, launcher.RETRY_FACTORY).retries_server_errors
        seen["unstored-retried"] = getattr(fleet, object_pushes.PUSH_FACTORY).retries_unstored

    monkeypatch.setattr(flwr.supernode.cli, "flower_supernode", fake_supernode)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.delenv(launcher.SUPEREXEC_POLL_VAR, raising=False)
    args = ["--superlink", "127.0.0.1:9092", "--insecure", "--node-config", "client-id=0"]
    assert launcher.main(["--poll-interval", "0.25", "--max-poll-interval", "2", *args]) == 0
    assert seen == {
        "argv": ["flower-supernode", *args],
        "superexec-poll": "0.25",
        "waits": (0.25, 2.0),
        "stopped-runs-fail": True,
        "superexec-longest-poll": "2.0",
        "500s-retried": launcher.SERVER_ERROR_RETRIES,
        "unstored-retried": object_pushes.RETRIES,
    }
    assert launcher.stop_children in loop.registered_at_exit


def test_the_superexec_setting_in_the_environment_wins(loop, monkeypatch):
    import flwr.supernode.cli

    seen: list[str | None] = []
    monkeypatch.setattr(
        flwr.supernode.cli,
        "flower_supernode",
        lambda: seen.append(os.environ.get(launcher.SUPEREXEC_POLL_VAR)),
    )
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv(launcher.SUPEREXEC_POLL_VAR, "0.5")
    launcher.main(["--insecure"])
    assert seen == ["0.5"]


@pytest.mark.parametrize("bad", [0.0, -1.0, 0.001, 61.0, math.nan, math.inf])
def test_a_bad_poll_interval_is_refused_naming_it(bad, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--poll-interval.*got " + repr(bad)):
        DeployOptions(workdir=tmp_path, poll_interval=bad)
    with pytest.raises(ValueError, match=r"longest .*got " + repr(bad)):
        DeployOptions(workdir=tmp_path, max_poll_interval=bad)
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["--poll-interval", str(bad)])
    assert exit_info.value.code == 2
    assert repr(bad) in capsys.readouterr().err


def test_the_longest_wait_may_not_be_below_the_first(tmp_path):
    with pytest.raises(ValueError, match=r"longest poll interval 0\.2 is below the first, 0\.5"):
        DeployOptions(workdir=tmp_path, poll_interval=0.5, max_poll_interval=0.2)
    DeployOptions(workdir=tmp_path, poll_interval=None, max_poll_interval=0.01)  # unused then


def test_the_local_deployment_starts_supernodes_through_it(tmp_path, monkeypatch):
    monkeypatch.delenv(launcher.SUPEREXEC_POLL_VAR, raising=False)
    short = LocalDeployment(DeployOptions(workdir=tmp_path / "a"))
    assert short.supernode_command() == [
        sys.executable,
        "-m",
        "fedfm_flower.deploy.supernode",
        "--poll-interval",
        "0.1",
        "--max-poll-interval",
        "1.0",
        "--warm-executor",
    ]
    assert short.env()[launcher.SUPEREXEC_POLL_VAR] == "0.1"  # the SuperLink's SuperExec too

    plain = LocalDeployment(DeployOptions(workdir=tmp_path / "b", poll_interval=None))
    (command,) = plain.supernode_command()
    assert command.endswith("flower-supernode")
    assert launcher.SUPEREXEC_POLL_VAR not in plain.env()


def test_the_command_line_switches_between_short_and_flower_waits():
    parser = build_parser("deploy")
    assert parser.parse_args([]).poll_interval == launcher.DEFAULT_POLL_INTERVAL
    assert parser.parse_args(["--poll-interval", "0.5"]).poll_interval == 0.5
    assert parser.parse_args(["--max-poll-interval", "3"]).max_poll_interval == 3.0
    assert parser.parse_args(["--flower-waits"]).flower_waits is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--flower-waits", "--poll-interval", "0.5"])


@pytest.fixture
def heartbeat(monkeypatch):
    """Flower's modules that read the node heartbeat interval, restored after the test."""
    modules = [importlib.import_module(name) for name in launcher.HEARTBEAT_MODULES]
    for module in modules:
        monkeypatch.setattr(
            module, launcher.HEARTBEAT_NAME, getattr(module, launcher.HEARTBEAT_NAME)
        )
    return modules


def test_the_heartbeat_interval_is_announced_and_kept_by_the_nodes_modules(heartbeat):
    from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_MIN_INTERVAL

    # What the launcher relies on: both modules read Flower's constant by that name, and the
    # SuperLink accepts intervals down to 10 s.
    assert launcher.MIN_HEARTBEAT_S == HEARTBEAT_MIN_INTERVAL
    fleet, sender = heartbeat
    assert "heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL" in inspect.getsource(fleet)
    assert "HEARTBEAT_DEFAULT_INTERVAL - HEARTBEAT_CALL_TIMEOUT" in inspect.getsource(sender)
    assert all(getattr(m, launcher.HEARTBEAT_NAME) == HEARTBEAT_DEFAULT_INTERVAL for m in heartbeat)
    assert launcher.shorten_heartbeat(12.0) is True
    assert all(getattr(m, launcher.HEARTBEAT_NAME) == 12.0 for m in heartbeat)
    with pytest.raises(ValueError, match="heartbeat interval must be in .10, 1800. seconds, got 5"):
        launcher.shorten_heartbeat(5.0)


def test_an_unknown_flower_keeps_its_heartbeat_and_says_so(heartbeat, monkeypatch, capsys):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0")
    assert launcher.shorten_heartbeat(10.0) is False
    assert all(getattr(m, launcher.HEARTBEAT_NAME) == 30 for m in heartbeat)
    assert "keeps Flower's heartbeat interval" in capsys.readouterr().err


def test_the_deployment_passes_the_heartbeat_interval_and_refuses_a_bad_one(tmp_path):
    options = DeployOptions(workdir=tmp_path / "a", heartbeat_interval=10.0)
    command = LocalDeployment(options).supernode_command()
    assert command[command.index("--heartbeat-interval") + 1] == "10.0"
    assert (
        "--heartbeat-interval"
        not in LocalDeployment(DeployOptions(workdir=tmp_path)).supernode_command()
    )
    with pytest.raises(ValueError, match="--heartbeat-interval: heartbeat interval must be"):
        DeployOptions(workdir=tmp_path, heartbeat_interval=3.0)
    with pytest.raises(ValueError, match="needs the short waits"):
        DeployOptions(workdir=tmp_path, heartbeat_interval=10.0, poll_interval=None)
    parser = build_parser("deploy")
    assert parser.parse_args(["--heartbeat-interval", "15"]).heartbeat_interval == 15.0
    assert parser.parse_args([]).superlink_database is None
    memory = parser.parse_args(["--superlink-database", ":flwr-in-memory:"])
    assert memory.superlink_database == ":flwr-in-memory:"


def test_the_superlink_keeps_its_state_in_a_fresh_file_or_where_the_options_say(tmp_path):
    deployment = LocalDeployment(DeployOptions(workdir=tmp_path / "a"))
    command = deployment.superlink_command()
    database = command[command.index("--database") + 1]
    assert database == str(tmp_path / "a" / "superlink" / "state.db")
    assert "--enable-supernode-auth" in command and "--insecure" not in command
    memory = LocalDeployment(DeployOptions(workdir=tmp_path, superlink_database=":flwr-in-memory:"))
    command = memory.superlink_command()
    assert command[command.index("--database") + 1] == ":flwr-in-memory:"


def test_the_superlinks_superexec_polls_at_the_longest_wait_the_nodes_at_the_first(
    tmp_path, monkeypatch
):
    monkeypatch.delenv(launcher.SUPEREXEC_POLL_VAR, raising=False)
    started: dict[str, dict[str, str]] = {}
    deployment = LocalDeployment(
        DeployOptions(workdir=tmp_path, poll_interval=0.2, max_poll_interval=2.0, insecure=True)
    )
    deployment.base_port = 19190
    monkeypatch.setattr(
        deployment, "_start", lambda name, command, env=None: started.setdefault(name, env)
    )
    monkeypatch.setattr(deployment, "wait_for_superlink", lambda timeout: None)
    deployment.start_superlink()
    assert started["superlink"][launcher.SUPEREXEC_POLL_VAR] == "2.0"  # one ServerApp per run
    assert deployment.env()[launcher.SUPEREXEC_POLL_VAR] == "0.2"  # the nodes' SuperExecs
    monkeypatch.setenv(launcher.SUPEREXEC_POLL_VAR, "0.5")  # the user's setting wins
    started.clear()
    deployment.start_superlink()
    assert started["superlink"][launcher.SUPEREXEC_POLL_VAR] == "0.5"


def test_the_installed_flower_is_a_known_one() -> None:
    assert is_known(flower_version())


@pytest.mark.parametrize("version", ["1.40.2", "1.43.0", "2.0.0", "1.4.1"])
def test_every_guard_refuses_a_flower_not_checked(version, loop, heartbeat, monkeypatch, capsys):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    assert not is_known(version)
    assert launcher.shorten_waits(0.1, 1.0) is False and loop.time is time
    assert launcher.fail_pulls_of_stopped_runs() is False
    assert launcher.shorten_heartbeat(10.0) is False
    assert launcher.retry_server_errors() is False
    assert launcher.retry_object_pushes() is False
    fleet = importlib.import_module(launcher.FLEET_MODULE)
    assert not hasattr(getattr(fleet, launcher.RETRY_FACTORY), "retries_server_errors")
    assert f"Flower {version} is not one it knows" in superexec.unsupported_flower()
    assert capsys.readouterr().err.count(f"Flower {version}") == 5


def _status_error(code: int):
    import httpx

    request = httpx.Request("POST", "https://superlink/fleet")
    response = httpx.Response(code, request=request, json={"detail": "Internal server error."})
    return httpx.HTTPStatusError(f"{code}", request=request, response=response)


def _invoker(loop):
    """The retry invoker the node's Fleet connection makes, without its waits."""
    fleet = importlib.import_module(launcher.FLEET_MODULE)
    invoker = getattr(fleet, launcher.RETRY_FACTORY)()
    invoker.wait_function = lambda seconds: None
    return invoker


def _failing(codes: list[int]):
    """A request that fails with each status of ``codes`` in turn, then answers 'ok'."""
    calls: list[int] = []

    def request() -> str:
        calls.append(len(calls))
        if len(calls) <= len(codes):
            raise _status_error(codes[len(calls) - 1])
        return "ok"

    return request, calls


def test_in_flower_a_superlinks_500_costs_the_request_at_once(loop):
    # What the patch is for: Flower retries 502-504, not the 500 a locked SQLite state gives.
    request, calls = _failing([500])
    with pytest.raises(Exception, match="500"):
        _invoker(loop).invoke(request)
    assert len(calls) == 1
    request, calls = _failing([503, 503])
    assert _invoker(loop).invoke(request) == "ok" and len(calls) == 3


def test_with_the_patch_500s_are_retried_a_bounded_number_of_times_in_a_row(loop):
    assert launcher.retry_server_errors(retries=3) is True
    assert launcher.retry_server_errors(retries=3) is True  # again: no double wrap
    invoker = _invoker(loop)
    request, calls = _failing([500, 500, 500])
    assert invoker.invoke(request) == "ok" and len(calls) == 4
    request, calls = _failing([500, 503, 500, 500])  # Flower's own retries still apply
    assert invoker.invoke(request) == "ok" and len(calls) == 5
    request, calls = _failing([500] * 4)  # a fourth 500 in a row: given up, as Flower does
    with pytest.raises(Exception, match="500"):
        invoker.invoke(request)
    assert len(calls) == 4
    request, calls = _failing([404])  # not a server error: Flower's answer, no retry
    with pytest.raises(Exception, match="404"):
        _invoker(loop).invoke(request)
    assert len(calls) == 1


def test_an_exiting_node_takes_its_children_and_theirs_with_it(monkeypatch):
    import subprocess

    monkeypatch.setattr(launcher, "EXITING", threading.Event())
    # a child that ignores SIGTERM (as a busy flwr-clientapp may), and a grandchild
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    parent = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {stubborn!r}]); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", parent])
    deadline = time.monotonic() + 30
    while len(launcher.descendants(os.getpid())) < 2:
        assert time.monotonic() < deadline, "the grandchild did not start"
        time.sleep(0.05)
    started = time.monotonic()
    stopped = launcher.stop_children(grace=0.5)
    assert child.pid in stopped and len(stopped) == 2
    assert child.wait(10) == -15  # SIGTERM
    assert time.monotonic() - started < 10
    while [pid for pid in stopped if pid_alive(pid)]:  # the stubborn one: SIGKILL
        assert time.monotonic() - started < 10, "a child outlived its SIGKILL"
        time.sleep(0.05)
    assert launcher.EXITING.is_set()  # and no SuperExec is started again


def test_an_object_the_superlink_did_not_store_is_pushed_again_a_bounded_number_of_times(
    loop, monkeypatch
):
    from flwr.proto.message_pb2 import PushObjectResponse  # pylint: disable=E0611
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    fleet = importlib.import_module(launcher.FLEET_MODULE)
    answers: list[bool] = []

    def superlink(request):  # stored as the answers say, in turn
        return PushObjectResponse(stored=answers.pop(0))

    def pushes(stored: list[bool]):
        answers[:] = stored
        push = getattr(fleet, object_pushes.PUSH_FACTORY)(superlink, Node(node_id=1), 7, "session")
        return push

    with pytest.raises(ObjectPushError):  # Flower: the reply is given up at the first refusal
        pushes([False, True])("abc", b"x")
    assert launcher.retry_object_pushes(retries=3, first_pause=0.5) is True
    pushes([False, False, True])("abc", b"x")
    assert slept == [0.5, 1.0] and answers == []
    slept.clear()
    with pytest.raises(ObjectPushError):  # refused four times: given up, as Flower does
        pushes([False] * 4)("abc", b"x")
    assert slept == [0.5, 1.0, 2.0]


def test_a_reply_ready_after_the_last_push_is_pushed_without_waiting_for_a_message(
    loop, monkeypatch
):
    """Two messages in flight: the loop pushed the first reply; the second, stored a moment
    later, is pushed on the next empty pull instead of waiting for the next message."""
    from flwr.app import ConfigRecord, Message, Metadata, RecordDict
    from flwr.supercore.object_store.object_store_factory import ObjectStoreFactory
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

    def message(run_id: int, name: str) -> Message:
        metadata = Metadata(
            run_id=run_id,
            message_id="",
            src_node_id=0,
            dst_node_id=9,
            reply_to_message_id="",
            group_id="",
            created_at=time.time(),
            ttl=600.0,
            message_type="query",
        )
        return Message(metadata=metadata, content=RecordDict({name: ConfigRecord({"x": 1})}))

    state = InMemoryNodeState(ObjectStoreFactory().store())
    first, second = message(5, "a"), message(6, "b")
    for incoming in (first, second):
        incoming.metadata.__dict__["_message_id"] = incoming.object_id
        state.store_message(incoming)
    state.get_messages_legacy(is_reply=False)  # both taken by the node's tasks
    replies = []
    for incoming in (first, second):
        reply = Message(RecordDict({"r": ConfigRecord({"y": 2})}), reply_to=incoming)
        reply.metadata.__dict__["_message_id"] = reply.object_id
        replies.append(reply)
    state.store_message(replies[0])
    assert [m.metadata.run_id for m in state.get_messages_legacy(is_reply=True)] == [5]  # pushed
    state.store_message(replies[1])  # ready a moment after that push
    monkeypatch.setattr(loop, launcher.PULL_AND_STORE, lambda **kwargs: None)  # no new message
    assert launcher.push_stranded_replies() is True
    assert launcher.push_stranded_replies() is True  # once
    pull = getattr(loop, launcher.PULL_AND_STORE)
    assert pull(state=state) == 6  # the loop pushes now: the reply's run
    assert [m.metadata.run_id for m in state.get_messages_legacy(is_reply=True)] == [6]
    assert pull(state=state) is None  # nothing left unsent
    assert launcher.stranded_reply_run(object()) is None  # another NodeState: no guess
    # What it relies on: the loop pushes only after a pull returned a run.
    source = inspect.getsource(loop.start_client_internal)
    assert "if run_id is None:" in source and "_push_messages(" in source
