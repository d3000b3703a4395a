"""An in-process ``Grid``: runs the real ServerApp loop against the real ClientApp in one process.

Used by the test suite and the benchmarks: no Ray, no SuperLink, deterministic, fast. Each node
keeps its own ``Context`` (so ``context.state`` persists across rounds as in simulation). Faults
can be injected: ``reply_hook`` may alter or drop a reply, ``offline`` removes nodes, and
``restart_node`` gives a node a fresh id and an empty context, as a restarted SuperNode has.

Imports inside functions keep ``flwr.common``, ``flwr.supercore``, ``numpy`` and ``torch`` out
of this module's start-up.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.records import protocol as P

if TYPE_CHECKING:
    from server_apps.runner import EarlyStop

ReplyHook = Callable[[int, Message], Message | None]


class ServerCrash(Exception):
    """Raised by ``crash_in_round``: the ServerApp dies mid-round, as a killed process would."""


def crash_in_round(server_round: int) -> ReplyHook:
    """A reply hook that kills the run when the first training reply of ``server_round`` comes
    back (the clients have trained that round; the server has not checkpointed it)."""

    def hook(client_id: int, reply: Message) -> Message | None:
        metadata = reply.metadata
        if metadata.group_id == str(server_round) and metadata.message_type == "train":
            raise ServerCrash(f"the ServerApp dies in round {server_round}")
        return reply

    return hook


def identity_app() -> ClientApp:
    """A ClientApp that only answers the identity query, from the node config (strategy tests
    and benchmarks that need the node mapping but no training)."""

    app = ClientApp()

    @app.query()
    def query(message: Message, context: Context) -> Message:
        node = context.node_config
        metrics = {P.CLIENT_ID: int(node.get("client-id", node.get("partition-id", -1)))}
        if "partition-id" in node:
            metrics[P.PARTITION_ID] = int(node["partition-id"])
        if "num-partitions" in node:
            metrics[P.NUM_PARTITIONS] = int(node["num-partitions"])
        facts = ConfigRecord({P.CAPABILITIES: str(node.get(P.CAPABILITIES, ""))})
        content = RecordDict({P.METRICS: MetricRecord(metrics), P.CONFIG: facts})
        return Message(content, reply_to=message)

    return app


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process."""

    def __init__(
        self,
        client_app: ClientApp,
        run_config: Mapping[str, Any],
        node_configs: list[dict[str, Any]],
        reply_hook: ReplyHook | None = None,
        run_id: int = 1,
    ) -> None:
        self.client_app = client_app
        self.run_config = dict(run_config)
        self.reply_hook = reply_hook
        self.run_id = run_id
        self.offline: set[int] = set()
        self._ids = itertools.count(1001)
        self.contexts: dict[int, Context] = {}
        for node_config in node_configs:
            self._add_node(dict(node_config))
        self._replies: dict[str, Message] = {}
        self.sent: list[Message] = []
        _claim_server_identity(run_id)

    def _add_node(self, node_config: dict[str, Any]) -> int:
        node_id = next(self._ids)
        self.contexts[node_id] = Context(
            run_id=self.run_id,
            node_id=node_id,
            node_config=node_config,
            state=RecordDict(),
            run_config=self.run_config,
        )
        return node_id

    def restart_node(self, node_id: int, keep_id: bool = False) -> int:
        """Replace a node by a fresh one with the same node config and an empty state."""
        context = self.contexts.pop(node_id)
        if keep_id:
            self.contexts[node_id] = Context(
                run_id=self.run_id,
                node_id=node_id,
                node_config=context.node_config,
                state=RecordDict(),
                run_config=self.run_config,
            )
            return node_id
        return self._add_node(dict(context.node_config))

    # Grid API -------------------------------------------------------------------------
    def set_run(self, run_id: int) -> None:
        """Set the run id (kept for API compatibility)."""
        self.run_id = run_id

    @property
    def run(self) -> Any:
        """Not backed by a SuperLink: there is no Run object."""
        raise NotImplementedError("InProcessGrid has no SuperLink run")

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """A message to ``dst_node_id``."""
        return Message(
            content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl
        )

    def get_node_ids(self) -> Iterable[int]:
        """Ids of the nodes that are online."""
        return [n for n in self.contexts if n not in self.offline]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message to its node's ClientApp now; keep the replies."""
        ids = []
        for message in messages:
            message_id = uuid.uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            message.metadata.__dict__["_run_id"] = self.run_id
            self.sent.append(message)
            ids.append(message_id)
            node_id = message.metadata.dst_node_id
            if node_id not in self.contexts or node_id in self.offline:
                continue
            try:
                reply = self.client_app(message, self.contexts[node_id])
            except Exception as err:  # noqa: BLE001 - a client failure becomes an error reply
                reply = Message(
                    Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message
                )
            client_id = int(
                self.contexts[node_id].node_config.get(
                    "client-id", self.contexts[node_id].node_config.get("partition-id", -1)
                )
            )
            if self.reply_hook is not None:
                reply = self.reply_hook(client_id, reply)
            if reply is not None:
                self._replies[message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to ``message_ids`` that exist."""
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push then pull (replies are ready at once)."""
        return self.pull_messages(self.push_messages(messages))


def _claim_server_identity(run_id: int) -> None:
    """Messages read the sender's identity from TaskIdentity; a real ServerApp process sets it."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = 0  # Flower's id for the server side
    TaskIdentity.task_id = 0


def simulation_node_configs(num_nodes: int, **extra: Any) -> list[dict[str, Any]]:
    """Node configs as Flower simulation makes them (partition-id, num-partitions)."""
    return [{"partition-id": i, "num-partitions": num_nodes, **extra} for i in range(num_nodes)]


def run_in_process(
    run_config: Mapping[str, Any],
    num_nodes: int,
    reply_hook: ReplyHook | None = None,
    node_configs: list[dict[str, Any]] | None = None,
    early_stop: EarlyStop | None = None,
) -> tuple[dict[str, Any], InProcessGrid]:
    """Run a full experiment in this process (``early_stop``: ``run_experiment``'s); returns
    (summary, grid)."""
    from client_apps.app import app as client_app
    from server_apps.runner import run_experiment

    full = {**ExperimentConfig().to_run_config(), **run_config}
    grid = InProcessGrid(
        client_app, full, node_configs or simulation_node_configs(num_nodes), reply_hook
    )
    summary = run_experiment(grid, ExperimentConfig.from_run_config(full), early_stop)
    return summary, grid
