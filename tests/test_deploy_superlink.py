"""The SuperLink launcher (``fedfm_flower.deploy.superlink``) and the object-push retry of a
deployed ServerApp (``fedfm_flower.deploy.object_pushes``): what they change in Flower's
SQLite state and grid, checked on Flower's own classes with a state file on disk."""

from __future__ import annotations

import importlib
import sqlite3
import sys
from pathlib import Path

import pytest

from fedfm_flower.deploy import DeployOptions, LocalDeployment, object_pushes
from fedfm_flower.deploy import superlink as launcher
from fedfm_flower.deploy.cli import build_parser


@pytest.fixture
def flower_state(monkeypatch, flowers_link_states):
    """Flower's SQLite settings and sweep, restored after the test."""
    pragmas = importlib.import_module(launcher.PRAGMAS_MODULE)
    monkeypatch.setattr(pragmas, "SQLITE_PRAGMAS", pragmas.SQLITE_PRAGMAS)
    state = importlib.import_module(launcher.STATE_MODULE).SqlCoreState
    sweep = getattr(state, launcher.SWEEP)
    monkeypatch.setattr(state, launcher.SWEEP, getattr(sweep, "__wrapped__", sweep))
    return pragmas, state


def sql_link_state(path: Path):
    """Flower's SQLite LinkState on ``path`` and a list that collects its SQL statements."""
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.superlink.federation import NoOpFederationManager
    from sqlalchemy import event

    state = SqlLinkState(str(path), NoOpFederationManager(), ObjectStoreFactory().store())
    state.initialize()
    statements: list[str] = []
    event.listen(
        state._engine,  # noqa: SLF001 - the one place Flower's statements can be seen
        "before_cursor_execute",
        lambda conn, cursor, statement, *rest: statements.append(statement),
    )
    return state, statements


def sweeps(statements: list[str]) -> int:
    """How many sweeps ``statements`` hold (each is two UPDATEs of the task table)."""
    return sum(s.lstrip().upper().startswith("UPDATE TASK") for s in statements) // 2


def test_connections_wait_for_the_lock_as_long_as_asked(flower_state, tmp_path):
    pragmas, _ = flower_state
    assert dict(pragmas.SQLITE_PRAGMAS)["busy_timeout"] == "5000"  # Flower's
    before = dict(pragmas.SQLITE_PRAGMAS)
    assert launcher.wait_longer_for_locks(42.5) is True
    assert dict(pragmas.SQLITE_PRAGMAS) == {**before, "busy_timeout": "42500"}
    state, _ = sql_link_state(tmp_path / "state.db")
    with state._engine.connect() as connection:  # noqa: SLF001
        seen = connection.exec_driver_sql("PRAGMA busy_timeout").scalar()
    assert seen == 42500
    # the file is Flower's ordinary state, readable by any SQLite
    tables = sqlite3.connect(tmp_path / "state.db").execute("SELECT name FROM sqlite_master")
    assert "run" in {name for (name,) in tables}


def test_expired_tokens_are_swept_at_most_once_a_second(flower_state, tmp_path, monkeypatch):
    state, statements = sql_link_state(tmp_path / "state.db")
    for _ in range(5):
        state.get_run_status({1})
    assert sweeps(statements) == 5  # Flower: a write transaction per status read

    clock = [1000.0]
    monkeypatch.setattr(launcher.time, "monotonic", lambda: clock[0])
    assert launcher.sweep_tokens_at_most_every(1.0) is True
    statements.clear()
    for _ in range(5):
        assert state.get_run_status({1}) == {}  # no such run: the reads still answer
    assert sweeps(statements) == 1
    clock[0] += 0.99
    state.get_run_status({1})
    assert sweeps(statements) == 1
    clock[0] += 0.02  # a second after the last sweep
    state.get_run_status({1})
    assert sweeps(statements) == 2
    other, other_statements = sql_link_state(tmp_path / "other.db")
    other.get_run_status({1})  # each state keeps its own time
    assert sweeps(other_statements) == 1
    assert launcher.sweep_tokens_at_most_every(1.0) is True  # twice: wraps Flower's, not itself
    wrapped = getattr(flower_state[1], launcher.SWEEP)
    assert wrapped.__wrapped__.__qualname__ == "SqlCoreState._cleanup_expired_task_tokens"


@pytest.mark.parametrize("version", ["1.40.2", "1.43.0", "2.0.0"])
def test_another_flower_keeps_its_settings_and_says_so(version, flower_state, monkeypatch, capsys):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    pragmas, state = flower_state
    before_pragmas, before_sweep = pragmas.SQLITE_PRAGMAS, getattr(state, launcher.SWEEP)
    assert launcher.wait_longer_for_locks(60.0) is False
    assert launcher.sweep_tokens_at_most_every(1.0) is False
    assert pragmas.SQLITE_PRAGMAS is before_pragmas
    assert getattr(state, launcher.SWEEP) is before_sweep
    assert capsys.readouterr().err.count(f"Flower {version}") == 2


def test_a_sweep_with_other_source_is_left_alone(flower_state, monkeypatch, capsys):
    _, state = flower_state

    def _cleanup_expired_task_tokens(self) -> None:  # Flower's name, another body
        return None

    monkeypatch.setattr(state, launcher.SWEEP, _cleanup_expired_task_tokens)
    assert launcher.sweep_tokens_at_most_every(1.0) is False
    assert getattr(state, launcher.SWEEP) is _cleanup_expired_task_tokens
    assert "task-token sweep is not the code this knows" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [0.5, 0.0, -3.0, float("nan"), float("inf"), 4000.0])
def test_a_bad_lock_wait_is_refused_naming_it(bad, flower_state, capsys):
    with pytest.raises(ValueError, match="lock wait"):
        launcher.check_lock_wait(bad)
    with pytest.raises(SystemExit) as exit_:
        launcher.main(["--lock-wait", repr(bad), "--insecure"])
    assert exit_.value.code == 2
    assert "--lock-wait" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--superlink-lock-wait"):
        DeployOptions(superlink_lock_wait=bad)


def test_main_hands_every_other_argument_to_flower_superlink(flower_state, monkeypatch):
    import flwr.superlink.cli
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState

    pragmas, state = flower_state
    seen: dict[str, object] = {}

    def fake_superlink() -> None:
        seen["argv"] = list(sys.argv)
        seen["lock-wait-ms"] = dict(pragmas.SQLITE_PRAGMAS)["busy_timeout"]
        seen["sweep-every-s"] = getattr(state, launcher.SWEEP).sweep_every_s
        seen["answers-for-restarted-nodes"] = hasattr(SqlLinkState.get_message_res, "__wrapped__")

    monkeypatch.setattr(flwr.superlink.cli, "flower_superlink", fake_superlink)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    args = ["--insecure", "--database", "state.db", "--isolation", "subprocess"]
    assert launcher.main(["--lock-wait", "30", *args]) == 0
    assert seen == {
        "argv": ["flower-superlink", *args],
        "lock-wait-ms": "30000",
        "sweep-every-s": launcher.SWEEP_EVERY_S,
        "answers-for-restarted-nodes": True,
    }


def test_the_deployment_starts_its_superlink_through_the_launcher(tmp_path):
    ours = LocalDeployment(DeployOptions(workdir=tmp_path, insecure=True, base_port=20100))
    command = ours.superlink_command()
    assert command[:5] == [
        sys.executable,
        "-m",
        "fedfm_flower.deploy.superlink",
        "--lock-wait",
        repr(launcher.DEFAULT_LOCK_WAIT_S),
    ]
    assert command[5:7] == ["--host", "127.0.0.1"] and command[-1] == "--insecure"
    plain = LocalDeployment(
        DeployOptions(workdir=tmp_path, insecure=True, base_port=20100, superlink_lock_wait=None)
    ).superlink_command()
    assert Path(plain[0]).name == "flower-superlink" and plain[1:] == command[5:]
    args = build_parser().parse_args(["--superlink-lock-wait", "12"])
    assert args.superlink_lock_wait == 12.0 and not args.flower_superlink
    assert build_parser().parse_args(["--flower-superlink"]).flower_superlink


def test_a_deployed_serverapp_pushes_an_unstored_object_again(monkeypatch):
    """Only Flower's HTTP grid (a deployment's) gets the retry; a simulation's grid does not."""
    from flwr.proto.message_pb2 import PushObjectResponse  # pylint: disable=E0611
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError
    from flwr.superlink.grid import HttpGrid, InMemoryGrid

    grid_module = importlib.import_module(object_pushes.GRID_MODULE)
    factory = getattr(grid_module, object_pushes.PUSH_FACTORY)
    monkeypatch.setattr(
        grid_module, object_pushes.PUSH_FACTORY, getattr(factory, "__wrapped__", factory)
    )
    slept: list[float] = []
    monkeypatch.setattr(object_pushes.time, "sleep", slept.append)
    answers: list[bool] = []

    def push_rpc(request):  # the SuperLink stores as ``answers`` say, in turn
        return PushObjectResponse(stored=answers.pop(0))

    def push(stored: list[bool]) -> None:
        answers[:] = stored
        make = getattr(grid_module, object_pushes.PUSH_FACTORY)
        make(push_rpc, Node(node_id=1), 7, "session")("abc", b"x")

    simulation_grid = InMemoryGrid.__new__(InMemoryGrid)
    assert object_pushes.retry_grid_object_pushes(simulation_grid) is False
    with pytest.raises(ObjectPushError):  # Flower's: the run fails at the first refusal
        push([False, True])
    deployed_grid = HttpGrid.__new__(HttpGrid)
    assert object_pushes.retry_grid_object_pushes(deployed_grid) is True
    push([False, False, True])
    assert slept == [0.5, 1.0] and answers == []


@pytest.mark.parametrize("form", ["separate", "joined"])
def test_the_database_directory_is_made_before_flower_opens_it(form: str, tmp_path: Path) -> None:
    database = tmp_path / "var" / "lib" / "fedfm" / "state.db"
    args = ["--insecure", *(["--database", str(database)] if form == "separate" else [])]
    if form == "joined":
        args.append(f"--database={database}")
    assert launcher.make_database_directory(args) == database.parent
    assert database.parent.is_dir()
    assert sqlite3.connect(database).execute("select 1").fetchone() == (1,)


def test_an_in_memory_database_makes_no_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert launcher.make_database_directory(["--database", ":flwr-in-memory:"]) is None
    assert launcher.make_database_directory(["--insecure"]) is None
    assert list(tmp_path.iterdir()) == []


def test_the_launchers_run_as_modules_without_runpys_warning() -> None:
    import subprocess

    for module in ("superlink", "supernode", "superexec"):
        command = [sys.executable, "-W", "error::RuntimeWarning", "-m"]
        result = subprocess.run(
            [*command, f"fedfm_flower.deploy.{module}", "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0 and "RuntimeWarning" not in result.stderr, result.stderr


def test_a_database_directory_that_cannot_be_made_is_one_line_naming_it(
    flower_state, tmp_path: Path, capsys
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exited:
        launcher.main(["--database", str(blocker / "state.db")])
    assert exited.value.code == 2
    assert "--database: cannot create its directory" in capsys.readouterr().err
