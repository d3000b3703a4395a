"""Chaos on a loopback deployment: SuperNodes and the ServerApp killed during a run, then checked.

    python -m fedfm_flower.deploy.chaos --supernodes 4 --rounds 20 --seed 0 --out runs/chaos

A seeded plan (``plan_chaos``) says what breaks and when; ``ChaosDriver`` carries it out on a
``LocalDeployment`` while one run goes on, and ``check_chaos`` then judges what the run left.
The kinds of event (``ChaosEvent.kind``):

* ``node-mid-training``: SuperNode ``node`` and its SuperExec are SIGKILLed while the node runs
  its training task of round ``round`` or later; the node is started again (same key, same
  node config and state directory) as soon as the SuperLink has marked it offline (two missed
  heartbeats: a minute with Flower's 30 s, 20 s with the command's ``--heartbeat-interval``
  10), while the run goes on without it.
* ``node-mid-write``: the node's write of its round-``round`` state stops half-way (the
  ``stall-save`` fault of ``client_apps.faults``, given in its node config) and the node is
  SIGKILLed then, its temporary file holding half the bytes; restarted as above.
* ``serverapp``: the ServerApp is SIGKILLed once round ``round`` is checkpointed and the next
  round's training has started, the run is stopped, and a new ``flwr run`` resumes it
  (``resume = true``).
* ``superlink``: at the same moment the SuperLink is SIGKILLed with its SuperExec and the
  ServerApp (``LocalDeployment.restart_superlink``) and started again on its state file; once
  every SuperNode has reconnected (its log says so, Flower's retries), the old run is stopped
  and a new ``flwr run`` resumes it. Needs the SuperLink's state on disk (the default).

``check_chaos`` then asks of the run directory and the nodes' state directories: the last run
completed; every round is recorded once, in order; no temporary file is left (but the leftover
of a mid-write kill whose client has not saved a later round since); every checkpoint and every
client state file reads and verifies (``fedfm_flower.records.durable``); every training reply
started from a state saved after the client's previous recorded training (or that one) and before
the round, whose digest is the file's on disk (no state lost, none torn; the run keeps every state
for this: ``keep-checkpoints`` = the rounds; a reply that came too late is not recorded, but
its state was saved); every client never killed is evaluated in the last round; and, given an
uninterrupted reference run, every client never killed reported exactly the reference's metrics
(timings aside) wherever both runs have its reply. With a method whose clients are independent
of one another (``local``, the command's default) that is exact: a killed client's later rounds
differ (it missed rounds), the others' must not.

Imports inside functions keep ``flwr.app``, ``numpy`` and ``torch`` out of this module's
start-up.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fedfm_flower.config.overrides import parse_overrides
from fedfm_flower.deploy.local import LocalDeployment
from fedfm_flower.deploy.options import CONNECTION, DeploymentError, DeployOptions
from fedfm_flower.deploy.processes import ManagedProcess
from fedfm_flower.deploy.runs import RunResult, resolve_run_config
from fedfm_flower.records.durable import DamagedFileError, load_tensors
from fedfm_flower.records.results import RunDirectory

KINDS = ("node-mid-training", "node-mid-write", "serverapp", "superlink")
NODE_KINDS = KINDS[:2]
SERVER_KINDS = KINDS[2:]  # the run is resumed after each
RECONNECTED = "Connection successful after"  # Flower's line when a retried request succeeds
UNTIMED = ("train-seconds",)  # metrics that differ between two identical runs


@dataclass(frozen=True)
class ChaosEvent:
    """One planned fault: ``kind`` at ``round`` (of SuperNode ``node`` for node kinds)."""

    kind: str
    round: int
    node: int | None = None


@dataclass
class ChaosRecord:
    """What happened for one event: when, in which round, what was killed, the restart."""

    event: ChaosEvent
    seconds: float = 0.0  # since the run started
    recorded_rounds: int = 0  # rounds in metrics.jsonl at the kill
    pids: list[int] = field(default_factory=list)
    restart_seconds: float | None = None  # node kinds: kill to restarted process
    skipped: str = ""  # why nothing was killed (a mid-write kill whose node missed the round)


def check_plan(plan: Sequence[ChaosEvent], rounds: int, num_nodes: int, rejoin: int) -> None:
    """Refuse a plan the driver cannot carry out, naming the event: a kind it does not know, a
    round outside 2..rounds-1, a node outside the federation, a node killed again within
    ``rejoin`` rounds (it may not be back), two ServerApp kills or SuperLink restarts in one
    round."""
    last: dict[int, int] = {}
    for event in sorted(plan, key=lambda e: e.round):
        if event.kind not in KINDS:
            raise ValueError(f"{event}: kind must be one of {', '.join(KINDS)}")
        if not 2 <= event.round <= rounds - 1:
            raise ValueError(f"{event}: round must be in 2..{rounds - 1}")
        if event.kind in NODE_KINDS:
            if event.node is None or not 0 <= event.node < num_nodes:
                raise ValueError(f"{event}: node must be in 0..{num_nodes - 1}")
            previous = last.get(event.node)
            if previous is not None and event.round - previous < rejoin:
                raise ValueError(f"{event}: node {event.node} was killed in round {previous}")
            last[event.node] = event.round
        elif event.node is not None:
            raise ValueError(f"{event}: a ServerApp kill or SuperLink restart names no node")
    servers = [e.round for e in plan if e.kind in SERVER_KINDS]
    if len(servers) != len(set(servers)):
        raise ValueError(
            f"two ServerApp kills or SuperLink restarts in one round: {sorted(servers)}"
        )


def plan_chaos(
    seed: int,
    rounds: int,
    num_nodes: int,
    node_kills: int,
    write_kills: int,
    serverapp_kills: int,
    spared: Sequence[int] = (0,),
    rejoin: int = 4,
    superlink_restarts: int = 0,
) -> list[ChaosEvent]:
    """A seeded plan: ``node_kills`` mid-training and ``write_kills`` mid-write kills of nodes
    not in ``spared``, ``serverapp_kills`` ServerApp kills and ``superlink_restarts``
    SuperLink restarts, in distinct rounds of
    2..rounds-rejoin (so every killed node is back for the last rounds), a node's kills at
    least ``rejoin`` rounds apart; ``ValueError`` when that does not fit."""
    rng = random.Random(seed)
    victims = [n for n in range(num_nodes) if n not in set(spared)]
    total = node_kills + write_kills + serverapp_kills + superlink_restarts
    window = list(range(2, rounds - rejoin + 1))
    if total and (not window or (node_kills + write_kills and not victims)):
        raise ValueError(f"no room for {total} events in {rounds} rounds of {num_nodes} nodes")
    for _ in range(1000):
        if len(window) < total:
            break
        chosen = sorted(rng.sample(window, total))
        kinds = ["node-mid-training"] * node_kills + ["node-mid-write"] * write_kills
        kinds += ["serverapp"] * serverapp_kills + ["superlink"] * superlink_restarts
        rng.shuffle(kinds)
        plan = []
        for kind, server_round in zip(kinds, chosen, strict=True):
            node = rng.choice(victims) if kind in NODE_KINDS else None
            plan.append(ChaosEvent(kind, server_round, node))
        try:
            check_plan(plan, rounds, num_nodes, rejoin)
        except ValueError:
            continue
        return plan
    raise ValueError(
        f"cannot fit {total} events in rounds 2..{rounds - rejoin} with {len(victims)} nodes "
        f"to kill, a node's kills {rejoin} rounds apart"
    )


def stall_overrides(plan: Sequence[ChaosEvent]) -> dict[int, dict[str, str]]:
    """Node config overrides that make the planned mid-write kills possible (``stall-save``)."""
    rounds: dict[int, list[int]] = {}
    for event in plan:
        if event.kind == "node-mid-write":
            assert event.node is not None
            rounds.setdefault(event.node, []).append(event.round)
    return {
        node: {"inject-fault": ",".join(f"{r}:stall-save" for r in sorted(found))}
        for node, found in rounds.items()
    }


def chaos_run_config(run_config: Mapping[str, Any], rounds: int) -> dict[str, Any]:
    """``run_config`` for a chaos run: ``rounds`` rounds, every checkpoint and client state
    kept (``check_chaos`` reads them all)."""
    return {**run_config, "num-server-rounds": rounds, "keep-checkpoints": rounds}


class ChaosDriver:
    """Carries out a plan on a started ``LocalDeployment`` during one run (``run``)."""

    def __init__(
        self,
        deployment: LocalDeployment,
        run_config: Mapping[str, Any],
        run_dir: Path,
        timeout: float = 1800.0,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.deployment = deployment
        self.run_config = dict(run_config)
        self.run_dir = run_dir
        self.deadline = time.monotonic() + timeout
        self.say = say or deployment.say
        self.records: list[ChaosRecord] = []
        self.results: list[RunResult] = []
        self._restarts: dict[int, threading.Thread] = {}
        self._restart_errors: list[str] = []
        self._started = 0.0  # set when ``run`` starts the run
        self._run: ManagedProcess | None = None  # the `flwr run` in progress
        self.watched: int | None = None  # a node the plan never kills (ServerApp kill timing)

    # -- waiting ------------------------------------------------------------------------------
    def _wait(self, condition: Callable[[], Any], what: str) -> Any:
        while time.monotonic() < self.deadline:
            value = condition()
            if value:
                return value
            run = self._run
            if run is not None and not run.alive():  # what it waits for can no longer happen
                run.join_output()
                raise DeploymentError(
                    f"chaos: the run ended (`flwr run` exit {run.popen.returncode}) while "
                    f"waiting for {what}; log {run.log_path}:\n{run.tail()}"
                )
            time.sleep(0.05)
        raise DeploymentError(f"chaos: the run's time ran out waiting for {what}")

    def recorded(self) -> int:
        """Rounds recorded in the run's metrics.jsonl so far."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        return sum(1 for line in path.read_text().splitlines() if line.strip())

    def _node_back(self, node: int) -> None:
        thread = self._restarts.get(node)
        if thread is not None:
            thread.join(max(0.0, self.deadline - time.monotonic()))

    def _new_task(self, node: int, server_round: int) -> None:
        """Wait until node ``node`` runs a training task of round ``server_round`` or later:
        round - 1 is recorded and a task started after that."""
        deployment = self.deployment
        self._wait(lambda: self.recorded() >= server_round - 1, f"round {server_round - 1}")
        finishing = deployment.tasks_in_flight(node)  # the last round's evaluation may end
        self._wait(
            lambda: deployment.tasks_in_flight(node) - finishing,
            f"a round-{server_round} task of SuperNode {node}",
        )

    def _temp_file(self, node: int, server_round: int) -> Path | None:
        client_dir = Path(self.deployment.node_config(node)["state-dir"]) / self.run_name
        found = sorted(client_dir.glob(f"client_*/.round_{server_round:05d}.safetensors.*.tmp"))
        return found[0] if found else None

    def _stalled_write(self, node: int, server_round: int) -> Path | None:
        """The temporary file of node ``node``'s stalled state write of ``server_round``, once
        the node has said it stalls (its half is in place then; the file appears earlier,
        while it is written in full)."""
        temp = self._temp_file(node, server_round)
        process = self.deployment.nodes.get(node)
        if temp is None or process is None:
            return None
        said = f"stalls half-way ({temp.name})"
        return temp if any(said in line for line in list(process.lines)) else None

    @property
    def run_name(self) -> str:
        """The run's name (its directory under the output dir and the state dirs)."""
        return str(self.run_config["run-name"])

    # -- events -------------------------------------------------------------------------------
    def _kill_node(self, record: ChaosRecord) -> None:
        event = record.event
        assert event.node is not None
        self._node_back(event.node)
        if event.kind == "node-mid-training":
            self._new_task(event.node, event.round)
        else:
            # The stall is of round `round` only: a node that missed that round never stalls.
            found = self._wait(
                lambda: (
                    self._stalled_write(event.node, event.round)
                    or ("missed" if self.recorded() > event.round else None)
                ),
                f"SuperNode {event.node}'s stalled write of round {event.round}",
            )
            if found == "missed":
                record.skipped = f"SuperNode {event.node} did not train round {event.round}"
                self.say(f"chaos: {record.skipped}; nothing killed")
                return
        record.recorded_rounds = self.recorded()
        record.pids = self.deployment.kill_supernode(event.node)
        killed = time.monotonic()

        def restart() -> None:
            try:
                self.deployment.restart_supernode(event.node)
                record.restart_seconds = time.monotonic() - killed
            except DeploymentError as err:
                self._restart_errors.append(f"SuperNode {event.node}: {err}")

        thread = threading.Thread(target=restart, name=f"restart-{event.node}", daemon=True)
        self._restarts[event.node] = thread
        thread.start()

    def _next_round_started(self, server_round: int) -> None:
        """Wait until round ``server_round`` is checkpointed and the next round's training runs
        on a node the plan spares: a server-side fault then strikes a round in progress, not
        messages in transit (a task whose message never arrives holds its executor for the
        pull's patience, superexec.PULL_PATIENCE_S). A task of that node seen now may be the
        last round's, still ending: only one started after the checkpoint counts."""
        checkpoint = self.run_dir / "checkpoints" / f"round_{server_round:05d}.json"
        self._wait(checkpoint.exists, f"the round-{server_round} checkpoint")
        watched = self.watched
        if watched is not None:
            finishing = self.deployment.tasks_in_flight(watched)
            self._wait(
                lambda: self.deployment.tasks_in_flight(watched) - finishing,
                f"a round-{server_round + 1} task of SuperNode {watched}",
            )

    def _kill_serverapp(self, record: ChaosRecord, run: ManagedProcess) -> ManagedProcess:
        self._next_round_started(record.event.round)
        record.recorded_rounds = self.recorded()
        record.pids = self.deployment.kill_serverapp()
        # Its `flwr run` streams until the run is stopped (`flwr stop`, which finish_run sends
        # when its wait times out): nothing to wait for.
        ended = self.deployment.finish_run(run, timeout=0)
        status = "serverapp-killed" if ended.status == "timeout" else ended.status
        self.results.append(replace(ended, status=status))
        self._run = self.deployment.start_run({**self.run_config, "resume": True})
        return self._run

    def _log_ends(self) -> dict[int, int]:
        """SuperNode -> how many lines its log has now."""
        return {node: len(process.lines) for node, process in self.deployment.nodes.items()}

    def _reconnected(self, waiting: dict[int, int]) -> bool:
        """Whether every SuperNode in ``waiting`` (node -> first log line not yet read) has
        logged a retried request's success since; reads each line once, dropping the nodes
        that have."""
        for node in list(waiting):
            lines = self.deployment.nodes[node].lines
            end = len(lines)
            if any(RECONNECTED in line for line in lines[waiting[node] : end]):
                del waiting[node]
            else:
                waiting[node] = end
        return not waiting

    def _restart_superlink(self, record: ChaosRecord, run: ManagedProcess) -> ManagedProcess:
        self._next_round_started(record.event.round)
        for node in list(self._restarts):  # a node restarting now would miss the SuperLink
            self._node_back(node)
        record.recorded_rounds = self.recorded()
        waiting = self._log_ends()
        killed = time.monotonic()
        record.pids = self.deployment.restart_superlink()
        ended = self.deployment.finish_run(run, timeout=0)
        if ended.run_id is not None:  # still "running" in the state file, with no ServerApp
            self.deployment.flwr("stop", str(ended.run_id), CONNECTION, timeout=60)
        self.results.append(replace(ended, status="superlink-restarted"))
        self._run = None  # nothing to watch until every node is back
        self._wait(
            lambda: self._reconnected(waiting),
            "every SuperNode to reconnect to the restarted SuperLink",
        )
        record.restart_seconds = time.monotonic() - killed
        self._run = self.deployment.start_run({**self.run_config, "resume": True})
        return self._run

    def run(self, plan: Sequence[ChaosEvent]) -> list[RunResult]:
        """Start the run, carry out ``plan`` in order of rounds, wait for the run's end and for
        every restarted node; returns each `flwr run`'s result (the last one resumed)."""
        self._started = time.monotonic()
        named = {e.node for e in plan}
        spared = [n for n in range(self.deployment.options.num_supernodes) if n not in named]
        self.watched = spared[0] if spared else None
        run = self._run = self.deployment.start_run(self.run_config)
        order = {kind: i for i, kind in enumerate((*SERVER_KINDS, *NODE_KINDS))}
        for event in sorted(plan, key=lambda e: (e.round, order[e.kind])):
            record = ChaosRecord(event)
            self.say(f"chaos: {event.kind} in round {event.round} (node {event.node})")
            if event.kind == "serverapp":
                run = self._kill_serverapp(record, run)
            elif event.kind == "superlink":
                run = self._restart_superlink(record, run)
            else:
                self._kill_node(record)
            record.seconds = time.monotonic() - self._started
            self.records.append(record)
        remaining = max(1.0, self.deadline - time.monotonic())
        self.results.append(self.deployment.finish_run(run, timeout=remaining))
        for node in list(self._restarts):
            self._node_back(node)
        if self._restart_errors:
            raise DeploymentError("chaos: restart failed: " + "; ".join(self._restart_errors))
        return self.results


# -- checks -----------------------------------------------------------------------------------
def _same_metrics(want: Mapping[str, Any], have: Mapping[str, Any]) -> list[str]:
    keys = (set(want) | set(have)) - set(UNTIMED)
    return sorted(k for k in keys if want.get(k) != have.get(k))


def check_chaos(
    run_dir: Path,
    state_dirs: Mapping[int, Path],
    rounds: int,
    killed: set[int],
    stalled: set[tuple[int, int]] = frozenset(),
    final: RunResult | None = None,
    reference_dir: Path | None = None,
) -> list[str]:
    """What is wrong with a chaos run (the module doc's checks); [] when nothing is.

    ``state_dirs``: client id -> its state directory for this run (``<state-dir>/<run-name>/
    client_<id>``); ``killed``: clients whose node was killed at least once; ``stalled``:
    (client, round) of the kills mid-write, whose temporary file stays until the client saves
    a later round."""
    from fedfm_flower.records.client_state import state_digest

    problems: list[str] = []
    if final is not None and not final.ok:
        problems.append(f"the last run did not complete: {final.status} {final.details}".strip())
    records = RunDirectory(run_dir).rounds() if (run_dir / "metrics.jsonl").exists() else []
    numbers = [int(r["round"]) for r in records]
    if numbers != list(range(1, rounds + 1)):
        problems.append(f"rounds recorded {numbers}, expected 1..{rounds} once each")
    for leftover in sorted(run_dir.rglob("*.tmp")):
        problems.append(f"temporary file left: {leftover}")
    for client, directory in sorted(state_dirs.items()):
        saved = [int(p.name[6:11]) for p in directory.glob("round_*.safetensors")]
        for leftover in sorted(directory.glob("*.tmp")):
            cut = int(leftover.name[7:12])  # .round_00007.safetensors.<random>.tmp
            if (client, cut) not in stalled or any(r > cut for r in saved):
                problems.append(f"temporary file left: {leftover}")
    files = sorted((run_dir / "checkpoints").glob("*.safetensors"))
    for directory in state_dirs.values():
        files += sorted(directory.glob("round_*.safetensors"))
    digests: dict[Path, int] = {}
    for path in files:
        try:
            digests[path] = state_digest(load_tensors(path))
        except DamagedFileError as err:
            problems.append(f"damaged file: {err}")
    for client, directory in sorted(state_dirs.items()):
        trained = [r for r in records if str(client) in r.get("train", {})]
        previous = 0
        for record in trained:
            reply = record["train"][str(client)]
            server_round, start = int(record["round"]), int(reply.get("state-round", 0))
            if not previous <= start < server_round:
                problems.append(
                    f"client {client} round {server_round}: started from its round-{start} "
                    f"state, expected one of rounds {previous}..{server_round - 1}"
                )
            if start and "state-digest" in reply:  # a privacy mode's replies have none
                path = directory / f"round_{start:05d}.safetensors"
                if digests.get(path) != int(reply.get("state-digest", -1)):
                    problems.append(
                        f"client {client} round {server_round}: the state it started from "
                        f"(digest {reply.get('state-digest')}) is not {path.name} on disk"
                    )
            previous = server_round
        if client not in killed and records and str(client) not in records[-1].get("evaluate", {}):
            problems.append(f"client {client}, never killed, is not evaluated in the last round")
    if reference_dir is not None:
        reference = RunDirectory(reference_dir).rounds()
        for want, have in zip(reference, records, strict=False):
            for phase in ("train", "evaluate"):
                # A reply that one run lacks (late, counted missing) is not compared.
                spared = set(want.get(phase, {})) - {str(c) for c in killed}
                for client in sorted(spared & set(have.get(phase, {}))):
                    got = have[phase][client]
                    differ = _same_metrics(want[phase][client], got)
                    if differ:
                        problems.append(
                            f"round {want['round']} {phase}: client {client} differs from the "
                            f"uninterrupted run in {', '.join(differ)}"
                        )
    return problems


def client_of(deployment: LocalDeployment, node: int) -> int:
    """The client id that SuperNode ``node`` serves."""
    return int(deployment.node_config(node)["client-id"])


def killed_clients(deployment: LocalDeployment, plan: Sequence[ChaosEvent]) -> set[int]:
    """Client ids of the nodes the plan kills."""
    return {
        client_of(deployment, e.node) for e in plan if e.kind in NODE_KINDS and e.node is not None
    }


def stalled_clients(
    deployment: LocalDeployment, plan: Sequence[ChaosEvent]
) -> set[tuple[int, int]]:
    """(client id, round) of the plan's kills mid-write."""
    return {
        (client_of(deployment, e.node), e.round)
        for e in plan
        if e.kind == "node-mid-write" and e.node is not None
    }


def client_state_dirs(deployment: LocalDeployment, run_name: str) -> dict[int, Path]:
    """Client id -> that client's state directory of run ``run_name``, for every node."""
    found = {}
    for node in range(deployment.options.num_supernodes):
        client, state_dir = client_of(deployment, node), deployment.node_config(node)["state-dir"]
        found[client] = Path(state_dir) / run_name / f"client_{client}"
    return found


# -- command ----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """The long chaos run: a seeded plan on a loopback deployment, checked; 0 when it holds."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.deploy.chaos", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--supernodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="seed of the plan")
    parser.add_argument("--node-kills", type=int, default=3, help="SuperNodes killed mid-training")
    parser.add_argument("--write-kills", type=int, default=2, help="SuperNodes killed mid-write")
    parser.add_argument("--serverapp-kills", type=int, default=2)
    parser.add_argument(
        "--superlink-restarts", type=int, default=1, help="SuperLink restarts on its state file"
    )
    parser.add_argument(
        "--shared-imports",
        action="store_true",
        help="fork the warm executors from one process (many SuperNodes on one machine)",
    )
    parser.add_argument(
        "--pull-patience",
        type=float,
        default=None,
        help="seconds a warm executor waits for its message's next object (default 90; raise "
        "it for many SuperNodes on few cores)",
    )
    parser.add_argument("--rejoin", type=int, default=4, help="rounds between a node's kills")
    parser.add_argument("--method", default="local")
    parser.add_argument("--round-timeout", type=float, default=40.0)
    parser.add_argument(
        "--heartbeat-interval", type=float, default=10.0, help="the SuperNodes', seconds"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run config (TOML values; a bare word is a string)",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for runs and report")
    args = parser.parse_args(argv)

    out = args.out.resolve()
    try:  # everything that can be refused before a process starts
        plan = plan_chaos(
            args.seed,
            args.rounds,
            args.supernodes,
            args.node_kills,
            args.write_kills,
            args.serverapp_kills,
            rejoin=args.rejoin,
            superlink_restarts=args.superlink_restarts,
        )
        options = DeployOptions(
            num_supernodes=args.supernodes,
            workdir=out / "work",
            startup_timeout=120.0,
            echo=False,
            warm_executor=True,
            heartbeat_interval=args.heartbeat_interval,
            shared_imports=args.shared_imports,
            pull_patience=args.pull_patience,
        )
        config = chaos_run_config(
            {
                "method": args.method,
                "round-timeout": args.round_timeout,
                "output-dir": str(out / "runs"),
                "run-name": "chaos",
                **parse_overrides(args.set),  # partitioner=iid and partitioner='iid' alike
            },
            args.rounds,
        )
        config = resolve_run_config(config, args.supernodes, options.app_dir)
    except ValueError as err:  # RunConfigError and ConfigError are ValueErrors too
        parser.error(str(err))
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"plan": [asdict(e) for e in plan], "run-config": config}
    started = time.monotonic()
    deployment = LocalDeployment(options)
    reference_dir = deployment.run_in_process(config, out / "reference")
    report["reference-seconds"] = time.monotonic() - started
    run_dir = Path(config["output-dir"]) / str(config["run-name"])
    driver = ChaosDriver(deployment, config, run_dir, timeout=args.timeout)
    problems: list[str] = []
    try:
        deployment.start(stall_overrides(plan))
        results = driver.run(plan)
        report["runs"] = [{"status": r.status, "seconds": r.seconds} for r in results]
    except DeploymentError as err:
        problems.append(str(err))
        results = []
    finally:
        deployment.stop()
    problems += check_chaos(
        driver.run_dir,
        client_state_dirs(deployment, driver.run_name),
        args.rounds,
        killed_clients(deployment, plan),
        stalled_clients(deployment, plan),
        results[-1] if results else None,
        reference_dir,
    )
    report["events"] = [{**asdict(r), "event": asdict(r.event)} for r in driver.records]
    report["problems"] = problems
    report["seconds"] = time.monotonic() - started
    (out / "chaos.json").write_text(json.dumps(report, indent=2) + "\n")
    for record in driver.records:
        event = record.event
        after = (
            f"restarted after {record.restart_seconds:.0f} s"
            if record.restart_seconds is not None
            else record.skipped or "resumed"
        )
        print(
            f"{event.kind:17s} round {event.round:3d} node {event.node} at {record.seconds:6.1f} s"
            f" ({record.recorded_rounds} rounds recorded), {after}"
        )
    print("\n".join(problems) or f"chaos held: {len(plan)} events, {args.rounds} rounds")
    print(f"report: {out / 'chaos.json'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
