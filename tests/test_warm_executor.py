"""The warm SuperExec (``fedfm_flower.deploy.superexec``) and how the SuperNode launcher keeps
it (``fedfm_flower.deploy.supernode --warm-executor``): the parts that need no deployment. The
loopback fault tests (``test_faults.py``) run their deployments through it."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor.types import ExecutionSpec, LaunchResultStatus

from fedfm_flower.deploy import DeployOptions, LocalDeployment, superexec, wake
from fedfm_flower.deploy import supernode as launcher


def spec(task_type: TaskType = TaskType.CLIENT_APP, **extra) -> ExecutionSpec:
    values = {
        "task_type": task_type,
        "runtime_api_address": "127.0.0.1:9094",
        "token": "t",
        "insecure": True,
        "root_certificates_path": None,
        "runtime_dependency_install": False,
        "parent_pid": None,
        "suppress_output": False,
        "task_id": 7,
        **extra,
    }
    return ExecutionSpec(**values)


class FlowerExecutor:
    """Stands in for Flower's executor: records what it is asked to launch."""

    def __init__(self) -> None:
        self.launched: list[ExecutionSpec] = []
        self.closed = False

    def get_eligible_capacity(self, types, *, insecure=False, root_certificates_path=None):
        return set(types), set()

    def wait_for_capacity(self, task_type=None, **kwargs) -> None:
        pass

    def launch(self, spec):
        from flwr.supercore.superexec.executor.types import LaunchResult

        self.launched.append(spec)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_the_installed_flower_is_the_one_it_knows() -> None:
    assert superexec.unsupported_flower() is None


def test_a_task_talks_to_its_supernode_as_flwr_clientapp_does() -> None:
    # What run_task mirrors: Flower's ClientApp process builds its runtime client with these
    # interceptors, in this order, and the same retry.
    from flwr.supernode.runtime import run_clientapp

    flower = inspect.getsource(run_clientapp.run_clientapp)
    ours = inspect.getsource(superexec.run_task)
    interceptors = [
        "RuntimeTracingInterceptor()",
        'RuntimeVersionHttpInterceptor(component_name="flwr-clientapp")',
    ]
    for source, token in (
        (flower, "RuntimeTokenHttpInterceptor(token)"),
        (ours, "RuntimeTokenHttpInterceptor(spec.token)"),
    ):
        positions = [source.index(text) for text in [*interceptors, token]]
        assert positions == sorted(positions)
    assert "make_simple_http_retry_invoker()" in flower


def test_another_flower_runs_flowers_superexec_with_the_same_arguments(monkeypatch, capsys):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.0.0")
    assert "Flower 9.0.0 is not one it knows" in superexec.unsupported_flower()
    executed = []
    monkeypatch.setattr(superexec.os, "execvp", lambda path, argv: executed.append(argv))
    argv = ["--runtime-api-address", "127.0.0.1:9094", "--insecure", "--parent-pid", "1"]
    superexec.main([*argv[:2], "--wake", "channel", *argv[2:]])
    assert executed and Path(executed[0][0]).name == "flower-superexec"
    assert executed[0][1:] == argv  # but ours, which Flower's would refuse
    assert superexec.without_wake(["--wake=x", "--insecure"]) == ["--insecure"]
    assert "running flower-superexec instead" in capsys.readouterr().err


def test_clientapp_tasks_run_here_one_at_a_time_and_the_rest_go_to_flower(monkeypatch):
    gate, ran = threading.Event(), []

    def fake_run_task(task, apps) -> None:
        ran.append(task.task_id)
        gate.wait(10)

    monkeypatch.setattr(superexec, "run_task", fake_run_task)
    flower = FlowerExecutor()
    executor = superexec.WarmExecutor(flower)
    every = {TaskType.CLIENT_APP, TaskType.SERVER_APP}
    assert executor.get_eligible_capacity(every)[0] == every

    assert executor.launch(spec(task_id=1)).status == LaunchResultStatus.ACCEPTED
    assert executor.busy() and flower.launched == []
    # while it runs: no capacity for another ClientApp task, other types still go to Flower
    assert executor.get_eligible_capacity(every)[0] == {TaskType.SERVER_APP}
    executor.launch(spec(TaskType.SERVER_APP, task_id=2))
    executor.launch(spec(task_id=3))  # one that arrives anyway: Flower's own process
    executor.launch(spec(task_id=4, runtime_dependency_install=True))
    assert [s.task_id for s in flower.launched] == [2, 3, 4]
    gate.set()
    executor.thread.join(10)
    assert not executor.busy() and ran == [1]
    executor.close()
    assert flower.closed


def test_stale_task_marks_of_a_killed_predecessor_are_cleared(tmp_path, monkeypatch):
    monkeypatch.setenv(superexec.TASKS_DIR_VAR, str(tmp_path))
    (tmp_path / "5.running").write_text("1")
    superexec.WarmExecutor(FlowerExecutor())
    assert not list(tmp_path.glob("*.running"))
    mark = superexec._marker(9)
    assert mark == tmp_path / "9.running" and mark.is_file()
    deployment = LocalDeployment(DeployOptions(workdir=tmp_path / "w", warm_executor=True))
    deployment.tasks_dir(0).mkdir(parents=True)
    (deployment.tasks_dir(0) / "11.running").write_text("1")
    assert "task:11" in deployment.tasks_in_flight(0)


def test_a_new_fab_drops_the_modules_of_the_old_one(tmp_path, monkeypatch):
    old = tmp_path / "fab-old"
    (old / "pkg_fab_probe").mkdir(parents=True)
    (old / "pkg_fab_probe" / "__init__.py").write_text("VERSION = 1\n")
    monkeypatch.syspath_prepend(str(old))
    import pkg_fab_probe

    assert pkg_fab_probe.VERSION == 1
    superexec.AppCache.forget(old)
    assert "pkg_fab_probe" not in sys.modules
    assert str(old) not in sys.path


def test_the_launcher_starts_the_node_in_process_isolation_beside_a_kept_superexec(monkeypatch):
    loop = importlib.import_module(launcher.LOOP_MODULE)
    stored = iter([7])  # the loop's next pull stores a message
    monkeypatch.setattr(loop, launcher.PULL_AND_STORE, lambda **kwargs: next(stored))
    keepers = []
    monkeypatch.setattr(launcher.ExecutorKeeper, "start", lambda self: keepers.append(self))
    args = ["--superlink", "127.0.0.1:9092", "--host", "127.0.0.1", "--port", "9111"]
    assert launcher.with_warm_executor(args) == [*args, "--isolation", "process"]
    assert [k.runtime_address for k in keepers] == ["127.0.0.1:9111"]
    # the SuperExec listens on a channel named on its command line, and a stored message wakes it
    command = keepers[0].command()
    name = command[command.index("--wake") + 1]
    heard = threading.Event()
    assert wake.listen(name, heard.set)
    assert getattr(loop, launcher.PULL_AND_STORE)(state=None) == 7
    assert heard.wait(10)
    keepers[0].failures = launcher.EXECUTOR_FAILURES
    assert "--wake" not in keepers[0].command()  # Flower's SuperExec would refuse it


def test_the_wake_channel_reaches_its_listener_only() -> None:
    name = wake.new_name()
    assert wake.send(name) is False  # nobody listens yet: the send fails at once, harmlessly
    heard: list[int] = []
    arrived = threading.Event()
    assert wake.listen(name, lambda: heard.append(1) or arrived.set()) is True
    assert wake.listen(name, lambda: None) is False  # one listener per name
    assert wake.send(name) is True and arrived.wait(10)
    assert wake.send(wake.new_name()) is False and heard == [1]


def test_a_woken_superexec_polls_on_wakes_and_task_ends_and_else_every_five_minutes(monkeypatch):
    polls = superexec.TaskPolls(1.0)
    name = wake.new_name()
    assert superexec.hear_wakes(polls, name) is True
    assert polls.woken and polls.cap == superexec.WOKEN_LONGEST_POLL_S == 300.0
    waited: list[float] = []
    wait = polls.ended.wait
    monkeypatch.setattr(polls.ended, "wait", lambda timeout: waited.append(timeout) or False)
    for _ in range(3):
        polls.sleep(0.1)  # Flower's time.sleep(task_poll_interval) after an empty poll
    assert waited == [300.0, 300.0, 300.0]  # no short polls, not even the first
    monkeypatch.setattr(polls.ended, "wait", wait)
    polls.poll_now()  # a task ended: poll at once
    started = time.monotonic()
    polls.sleep(0.1)
    assert time.monotonic() - started < 5
    threading.Timer(0.2, wake.send, args=(name,)).start()  # the SuperNode stored a message
    polls.sleep(0.1)
    assert time.monotonic() - started < 10  # woken, not after 5 min
    assert superexec.hear_wakes(superexec.TaskPolls(1.0), name) is False  # the name is taken


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--isolation", "subprocess"], "sets --isolation itself"),
        (["--appio-ssl-certfile", "c.pem"], "runtime API uses TLS"),
    ],
)
def test_the_launcher_keeps_flowers_isolation_when_it_must(extra, reason, monkeypatch, capsys):
    monkeypatch.setattr(launcher.ExecutorKeeper, "start", lambda self: pytest.fail("started"))
    args = ["--superlink", "127.0.0.1:9092", *extra]
    assert launcher.with_warm_executor(args) == args
    assert reason in capsys.readouterr().err


class NodeGone(Exception):
    """What ends the keeper's daemon thread in these tests: its SuperNode's process exiting."""


class Exits:
    """Popen stand-in: each process 'exits' at once with the next code; the node goes after."""

    def __init__(self, codes: list[int]) -> None:
        self.codes, self.commands = list(codes), []

    def __call__(self, command):
        if not self.codes:
            raise NodeGone
        self.commands.append(command)
        code = self.codes.pop(0)
        return SimpleNamespace(wait=lambda: code, pid=0)


def test_the_keeper_restarts_a_crashed_superexec_and_falls_back_to_flowers(monkeypatch, capsys):
    exits = Exits([-signal.SIGKILL, 1, 1, -signal.SIGKILL, 1])
    monkeypatch.setattr(launcher.subprocess, "Popen", exits)
    monkeypatch.setattr(launcher.time, "sleep", lambda s: None)
    with pytest.raises(NodeGone):
        launcher.ExecutorKeeper("127.0.0.1:9111").keep()
    ours = [c for c in exits.commands if "fedfm_flower.deploy.superexec" in c]
    theirs = [c for c in exits.commands if Path(c[0]).name == "flower-superexec"]
    assert len(ours) == 3 and len(theirs) == 2  # three quick crashes, then Flower's
    assert theirs[0][1:] == ours[0][3:]  # the same arguments
    assert "--runtime-api-address" in theirs[0] and "127.0.0.1:9111" in theirs[0]
    assert "starting Flower's" in capsys.readouterr().err


def test_a_superexec_that_stops_while_its_node_runs_is_started_again_after_the_grace(
    monkeypatch, capsys
):
    # A node's stop ends its SuperExec and, within the grace, the keeper's thread; a SuperExec
    # stopped by something else (Flower's heartbeat raised SIGINT in it) must come back.
    exits = Exits([-signal.SIGINT, 0, -signal.SIGTERM])
    slept: list[float] = []
    monkeypatch.setattr(launcher.subprocess, "Popen", exits)
    monkeypatch.setattr(launcher.time, "sleep", slept.append)
    with pytest.raises(NodeGone):
        launcher.ExecutorKeeper("127.0.0.1:9111").keep()
    assert len(exits.commands) == 3  # each stopped one started again, once the grace passed
    assert slept.count(launcher.STOPPED_GRACE_S) == 3
    assert all("fedfm_flower.deploy.superexec" in c for c in exits.commands)
    err = capsys.readouterr().err  # three quick exits in a row: Flower's SuperExec next
    assert err.count("starting it again") == 2 and err.count("starting Flower's") == 1


def test_a_crashed_superexec_is_started_again_without_the_grace(monkeypatch):
    exits = Exits([1])
    slept: list[float] = []
    monkeypatch.setattr(launcher.subprocess, "Popen", exits)
    monkeypatch.setattr(launcher.time, "sleep", slept.append)
    with pytest.raises(NodeGone):
        launcher.ExecutorKeeper("127.0.0.1:9111").keep()
    assert len(exits.commands) == 1 and launcher.STOPPED_GRACE_S not in slept


def test_the_options_and_command_line_pass_it_on(tmp_path):
    from fedfm_flower.deploy.cli import build_parser

    parser = build_parser("deploy")
    assert parser.parse_args([]).no_warm_executor is False
    assert parser.parse_args(["--no-warm-executor"]).no_warm_executor is True
    deployment = LocalDeployment(DeployOptions(workdir=tmp_path))  # the default
    assert deployment.supernode_command()[-1] == "--warm-executor"
    off = LocalDeployment(DeployOptions(workdir=tmp_path, warm_executor=False))
    assert "--warm-executor" not in off.supernode_command()
    # plain flower-supernode (Flower's waits) is Flower's path throughout
    assert DeployOptions(workdir=tmp_path, poll_interval=None).warm_executor is False


def test_a_message_whose_objects_arrive_late_is_still_pulled(monkeypatch) -> None:
    """The warm executor pulls with short pauses; an object that is still missing after more
    than Flower's 500 tries per object (a loaded SuperNode: 30-64 s with 16 nodes on 2 cores)
    is waited for, and so is a slow transfer as long as an object arrives every PULL_PATIENCE_S;
    one that never comes (its run was stopped) fails the pull after that time, so the executor
    is free for the next run."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, Message, RecordDict
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        get_object_tree,
    )
    from flwr.supercore.inflatable.inflatable_utils import (
        ObjectPullError,
        ObjectUnavailableError,
    )
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)  # what a task's process has set
    monkeypatch.setattr(superexec, "PULL_FIRST_PAUSE_S", 0.0)  # as many tries as it takes
    monkeypatch.setattr(superexec, "PULL_LONGEST_PAUSE_S", 0.0)
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.arange(6.0))})})
    message = Message(content, dst_node_id=3, message_type="train")
    objects = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    late = next(iter(objects))
    tries = {"late": 0}

    def pull(object_id: str) -> bytes:
        if object_id == late and tries["late"] < 700:  # more than Flower's 500 tries
            tries["late"] += 1
            raise ObjectUnavailableError(object_id)
        return objects[object_id]

    pulled = superexec.pull_message(get_object_tree(message), pull, lambda object_id: None)
    assert tries["late"] == 700
    assert np.array_equal(pulled.content["arrays"]["w"].numpy(), np.arange(6.0))

    def never(object_id: str) -> bytes:
        raise ObjectUnavailableError(object_id)

    monkeypatch.setattr(superexec, "PULL_PATIENCE_S", 0.3)
    started = time.monotonic()
    with pytest.raises(ObjectPullError, match="no object of the message arrived in 0 s"):
        superexec.pull_message(get_object_tree(message), never, lambda object_id: None)
    assert 0.3 <= time.monotonic() - started < 5.0

    # Slow but moving: each object comes 0.2 s after the one before, 0.2 * len > the patience
    # in all, but never 0.3 s without an arrival: the pull goes on to the end.
    assert len(objects) * 0.2 > 0.3
    due = {"at": time.monotonic() + 0.2}

    def trickle(object_id: str) -> bytes:
        if time.monotonic() < due["at"]:
            raise ObjectUnavailableError(object_id)
        due["at"] = time.monotonic() + 0.2
        return objects[object_id]

    started = time.monotonic()
    pulled = superexec.pull_message(get_object_tree(message), trickle, lambda object_id: None)
    assert time.monotonic() - started > 0.3
    assert np.array_equal(pulled.content["arrays"]["w"].numpy(), np.arange(6.0))


def test_the_pull_patience_can_be_raised_for_a_loaded_deployment(tmp_path) -> None:
    assert superexec.pull_patience({}) == superexec.PULL_PATIENCE_S == 90.0
    assert superexec.pull_patience({superexec.PULL_PATIENCE_VAR: "300"}) == 300.0
    for bad in ("0", "-5", "inf", "soon"):
        with pytest.raises(ValueError, match=f"FEDFM_PULL_PATIENCE_S='{bad}': must be a positive"):
            superexec.pull_patience({superexec.PULL_PATIENCE_VAR: bad})
    options = DeployOptions(workdir=tmp_path, pull_patience=300.0)
    assert LocalDeployment(options).env()[superexec.PULL_PATIENCE_VAR] == "300.0"
    assert superexec.PULL_PATIENCE_VAR not in LocalDeployment(DeployOptions(workdir=tmp_path)).env()
    with pytest.raises(ValueError, match="pull patience must be a positive number"):
        DeployOptions(workdir=tmp_path, pull_patience=0.0)


def test_a_refused_task_heartbeat_ends_nothing_but_is_logged_once(monkeypatch, caplog) -> None:
    """Flower's task heartbeat raises SIGINT in its process when the SuperNode refuses it: in
    the warm executor that would end the node's SuperExec; ours logs and goes on."""
    import logging

    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatResponse

    raised: list[int] = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    answers: list[object] = []

    class Client:
        def SendTaskHeartbeat(self, request):  # noqa: N802 - Flower's RPC name
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    def http_error(status: int) -> httpx.HTTPStatusError:
        request = httpx.Request("POST", "https://127.0.0.1/v1/runtime/send-task-heartbeat")
        return httpx.HTTPStatusError("x", request=request, response=httpx.Response(status))

    beat = superexec.task_heartbeat(Client(), 7)
    answers[:] = [SendTaskHeartbeatResponse(success=True), http_error(503), httpx.ConnectError("x")]
    assert [beat(), beat(), beat()] == [True, False, False]  # ok; retried like Flower's
    with caplog.at_level(logging.WARNING):
        answers[:] = [http_error(401)]
        assert beat() is True
        assert beat() is True  # not asked again, not logged again
    assert caplog.text.count("task 7: its heartbeat was refused (HTTP 401)") == 1
    refused = superexec.task_heartbeat(Client(), 8)
    answers[:] = [SendTaskHeartbeatResponse(success=False)]
    assert refused() is True
    assert raised == [] and not answers


def _refusal(status: int) -> Exception:
    import httpx

    request = httpx.Request("POST", "http://127.0.0.1/v1/runtime/pull-object")
    return httpx.HTTPStatusError("refused", request=request, response=httpx.Response(status))


def test_flowers_retry_ends_the_process_on_a_refused_token_or_a_stopped_run(monkeypatch) -> None:
    """What ``task_retry`` mends: Flower's retry sends SIGINT to its process on 401 and raises
    a BaseException on 403; when Flower changes this, this fails and the mend can go."""
    from flwr.supercore.retry import http_retry, make_simple_http_retry_invoker
    from flwr.supercore.run import RunNotRunningException

    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(http_retry.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(http_retry.time, "sleep", lambda seconds: None)
    flower = make_simple_http_retry_invoker()
    flower.should_giveup(_refusal(401))
    assert killed == [(os.getpid(), signal.SIGINT)]
    with pytest.raises(RunNotRunningException):
        flower.should_giveup(_refusal(403))
    assert not issubclass(RunNotRunningException, Exception)


def test_a_tasks_refused_request_fails_the_task_not_the_process(monkeypatch) -> None:
    import httpx
    from flwr.supercore.retry import http_retry

    killed: list[int] = []
    monkeypatch.setattr(http_retry.os, "kill", lambda pid, sig: killed.append(sig))
    retry = superexec.task_retry()
    calls: list[int] = []

    def refused(status: int) -> bytes:
        calls.append(status)
        raise _refusal(status)

    for status in superexec.REFUSED:
        with pytest.raises(httpx.HTTPStatusError) as raised:
            retry.invoke(refused, status)
        assert raised.value.response.status_code == status
    assert calls == list(superexec.REFUSED)  # each tried once: given up, not retried
    assert killed == []
    # What Flower retries stays retried: a busy or unreachable SuperNode.
    assert retry.should_giveup(_refusal(503)) is False
    assert retry.should_giveup(httpx.ConnectError("refused")) is False
    assert retry.should_giveup(_refusal(400)) is True  # and what it gives up on, too


def test_task_polls_back_off_while_idle_and_start_over_when_a_task_ends(monkeypatch):
    waited: list[float] = []
    polls = superexec.TaskPolls(1.0)
    monkeypatch.setattr(polls.ended, "wait", lambda timeout: waited.append(timeout) or False)
    for _ in range(8):
        polls.sleep(0.1)  # Flower's time.sleep(task_poll_interval) after a poll found no task
    assert waited == pytest.approx([0.1, 0.15, 0.225, 0.3375, 0.50625, 0.759375, 1.0, 1.0])
    waited.clear()
    polls.poll_now()  # a task ended: the next message follows a reply closely
    polls.sleep(0.1)
    polls.sleep(0.1)
    assert waited == pytest.approx([0.1, 0.15])
    waited.clear()
    polls.sleep(3.0)  # never more often than Flower's own interval
    assert waited == [3.0]
    assert polls.monotonic is time.monotonic


def test_a_task_that_ends_wakes_the_poll_at_once_even_when_it_failed(monkeypatch):
    gate = threading.Event()

    def failing_task(task, apps) -> None:
        gate.wait(10)
        raise RuntimeError("the ClientApp failed")

    monkeypatch.setattr(superexec, "run_task", failing_task)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    polls = superexec.TaskPolls(60.0)
    polls.sleep(0.1)  # the first pause: Flower's interval
    for _ in range(20):
        next(polls)  # grown to a minute
    executor = superexec.WarmExecutor(FlowerExecutor(), polls)
    executor.launch(spec(task_id=1))
    threading.Timer(0.2, gate.set).start()  # the task fails while the loop sleeps
    started = time.monotonic()
    polls.sleep(0.1)  # woken by the task's end, not after 60 s
    assert time.monotonic() - started < 10
    assert polls.upcoming == 0.1  # and the next pause is short again
    executor.thread.join(10)


def test_the_loop_gets_task_polls_only_with_a_longest_interval(monkeypatch):
    from flwr.supercore.superexec import run_superexec as loop

    monkeypatch.setattr(loop, "time", time)
    monkeypatch.setattr(loop, "get_executor", loop.get_executor)
    flowers = loop.get_executor
    superexec.install(loop)
    assert loop.time is time
    superexec.install(loop, 2.0)  # again: wraps Flower's factory, not ours
    assert isinstance(loop.time, superexec.TaskPolls) and loop.time.cap == 2.0
    assert loop.get_executor.flower_factory is flowers
    source = inspect.getsource(loop.run_superexec)
    assert "time.sleep(task_poll_interval)" in source  # the one sleep it stretches


@pytest.mark.parametrize("raw", ["x", "0", "-1", "61", "nan"])
def test_a_bad_longest_task_poll_is_refused_naming_it(raw):
    with pytest.raises(ValueError, match=superexec.MAX_POLL_VAR):
        superexec.longest_task_poll({superexec.MAX_POLL_VAR: raw})
    assert superexec.longest_task_poll({}) is None
    assert superexec.longest_task_poll({superexec.MAX_POLL_VAR: "1.5"}) == 1.5


def test_a_message_whose_content_never_arrives_is_still_answered(monkeypatch) -> None:
    """A task whose message's objects never reach it (the pull patience ran out) pushes Flower's
    error reply to that message, so its SuperNode is not left waiting for a reply for the rest
    of the run; a task that failed before it knew its message pushes none, as Flower's."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
    from flwr.app.message import remove_content_from_message
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.common.serde import message_to_proto
    from flwr.supercore import runtime
    from flwr.supercore.inflatable.inflatable_object import get_object_tree
    from flwr.supercore.inflatable.inflatable_utils import ObjectPullError
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supernode.runtime import run_clientapp

    for name, value in (("_run_id", 1), ("_node_id", 3), ("_task_id", 7)):
        monkeypatch.setattr(TaskIdentity, name, value)  # what a task's process has set
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.arange(6.0))})})
    message = Message(content, dst_node_id=3, message_type="train", group_id="4")
    message.metadata.__dict__["_src_node_id"] = 1
    tree = get_object_tree(message)
    listed = message_to_proto(remove_content_from_message(message))  # what PullMessages lists
    shell = superexec.message_shell(listed, tree.object_id)
    assert shell.metadata.message_id == tree.object_id == message.object_id
    assert (shell.metadata.message_type, shell.metadata.group_id) == ("train", "4")
    assert shell.metadata.dst_node_id == 3 and len(shell.content) == 0

    context = Context(run_id=1, node_id=3, node_config={}, state=RecordDict(), run_config={})
    pushed: list[Message] = []
    outputs: list[str] = []

    class Runtime:  # the SuperNode's runtime API as the task's client sees it
        def SendTaskHeartbeat(self, request):  # noqa: N802 - Flower's method name
            return type("Response", (), {"success": True})()

        def close(self) -> None:
            pass

    monkeypatch.setattr(runtime.RuntimeHttpClient, "from_server_address", lambda **kw: Runtime())
    monkeypatch.setattr(run_clientapp, "push_message", lambda c, reply, ctx: pushed.append(reply))
    monkeypatch.setattr(
        run_clientapp, "push_task_output", lambda **kw: outputs.append(kw["sub_status"])
    )

    def never_arrives(client, announced):
        announced(superexec.message_shell(listed, tree.object_id), context)
        raise ObjectPullError(tree.object_id, "no object of the message arrived in 90 s")

    spec = type(
        "Spec",
        (),
        {
            "task_id": 7,
            "runtime_api_address": "127.0.0.1:1",
            "insecure": True,
            "root_certificates_path": None,
            "token": "t",
        },
    )()
    monkeypatch.setattr(superexec, "pull_task_input", never_arrives)
    superexec.run_task(spec, superexec.AppCache())
    (reply,) = pushed
    assert reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "no object of the message arrived in 90 s" in reply.error.reason
    assert reply.metadata.reply_to_message_id == message.object_id
    assert reply.metadata.dst_node_id == 1 and reply.metadata.group_id == "4"
    assert outputs == [SubStatus.FAILED]

    def refused_at_once(client, announced):  # before the task knew its message
        raise RuntimeError("No messages received from Runtime API")

    pushed.clear()
    monkeypatch.setattr(superexec, "pull_task_input", refused_at_once)
    superexec.run_task(spec, superexec.AppCache())
    assert pushed == [] and outputs == [SubStatus.FAILED, SubStatus.FAILED]


def test_a_long_pull_looks_at_the_nodes_longest_interval(monkeypatch) -> None:
    """Looks for a message's objects come every PULL_LONGEST_PAUSE_S (Flower's backoff pause)
    for the first SLOW_PULL_S without an arrival, then every --max-poll-interval: the extra
    wait is taken before the look reports "not yet"."""
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    clock = [100.0]
    slept: list[float] = []
    monkeypatch.setattr(superexec.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(superexec.time, "sleep", slept.append)
    arrived = {"now": False}

    def pull(object_id: str) -> bytes:
        if arrived["now"]:
            return b"x"
        raise ObjectUnavailableError(object_id)

    patient = superexec.PatientPull(pull, patience=90.0, slow_pause=2.0)
    clock[0] += superexec.SLOW_PULL_S - 0.1  # not slow yet: no extra wait
    with pytest.raises(ObjectUnavailableError):
        patient("a")
    assert slept == []
    clock[0] += 0.2  # past SLOW_PULL_S without an arrival
    with pytest.raises(ObjectUnavailableError):
        patient("a")
    assert slept == [pytest.approx(2.0 - superexec.PULL_LONGEST_PAUSE_S)]
    arrived["now"] = True
    assert patient("a") == b"x"  # an arrival starts the count over
    arrived["now"] = False
    slept.clear()
    with pytest.raises(ObjectUnavailableError):
        patient("b")
    assert slept == []
    # The pause is the node's longest wait, else 1 s, never below Flower's 0.25 s.
    assert superexec.slow_pull_pause({}) == superexec.SLOW_PULL_PAUSE_S == 1.0
    assert superexec.slow_pull_pause({superexec.MAX_POLL_VAR: "3"}) == 3.0
    assert superexec.slow_pull_pause({superexec.MAX_POLL_VAR: "0.1"}) == 0.25
    with pytest.raises(ValueError, match=superexec.MAX_POLL_VAR):
        superexec.slow_pull_pause({superexec.MAX_POLL_VAR: "soon"})
