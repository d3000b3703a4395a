"""Which Flower node is which client, and what each client holds.

A strategy's state is keyed by the clients' *stable* ids, never by Flower node ids (they change
across runs and restarts). Before a round, nodes not seen before are sent a QUERY message; their
replies state their ``client-id``. Nodes that left are forgotten; two nodes claiming one client
id are reported and the newcomer is ignored (until a node leaves), as is a node whose client the
strategy refuses (``refuse_client``).

The identity query also returns what a client holds (its node config's ``capabilities``, e.g.
``image,text,vqa``), kept in ``capabilities`` by client id, so a strategy can give a component
only to the clients that have its modality or task, and the ``num-partitions`` the nodes report
(``num_partitions``: the number of clients, when the run does not set it). That number is the
one most nodes report (ties: the smallest), not the largest: a server sized from it holds a
slot per client, and one node's huge claim (a typo, or a client out to exhaust the server's
memory) must not size it. A node whose claim differs is named in a warning.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping

from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedfm_flower.records import protocol as P

log = logging.getLogger(__name__)

QUERY_TIMEOUT_S = 120.0


class NodeDirectory:
    """The node-to-client mapping learned by the identity query, and what each client holds."""

    def __init__(self, run_name: str, client_holdings: Mapping[int, tuple[str, ...]]) -> None:
        self.run_name = run_name
        self.client_holdings = client_holdings  # client id -> what the task's data gives it
        self.node_to_client: dict[int, int] = {}
        self.capabilities: dict[int, frozenset[str]] = {}  # client id -> what it declares
        self.partition_of: dict[int, int] = {}  # client id -> the partition its data are
        self.partition_claims: dict[int, int] = {}  # node id -> the num-partitions it reported
        self.refused_nodes: set[int] = set()  # answered with a client id that is refused

    def learn(self, grid: Grid, server_round: int, refuse: Callable[[int], str | None]) -> None:
        """Query nodes not seen before for their client id; forget nodes that left.

        ``refuse(client_id)`` says why a client cannot be served (None: it can); it is asked
        after the ``num-partitions`` of every node that answered this query is counted.
        """
        present = set(grid.get_node_ids())
        left = [n for n in self.node_to_client if n not in present]
        for node_id in left:
            log.info("node %s (client %s) left", node_id, self.node_to_client.pop(node_id))
        for node_id in [n for n in self.partition_claims if n not in present]:
            del self.partition_claims[node_id]
        # A node refused as a duplicate may be the rightful holder once the other one left.
        self.refused_nodes = set() if left else self.refused_nodes & present
        unknown = sorted(present - set(self.node_to_client) - self.refused_nodes)
        if not unknown:
            return
        messages = [
            Message(
                RecordDict({P.CONFIG: ConfigRecord({P.RUN_NAME: self.run_name})}),
                dst_node_id=node_id,
                message_type=MessageType.QUERY,
                group_id=f"query-{server_round}",
            )
            for node_id in unknown
        ]
        replies = list(grid.send_and_receive(messages, timeout=QUERY_TIMEOUT_S))
        for reply in replies:
            self._count_partitions(reply)
        consensus = self.num_partitions
        answered = {reply.metadata.src_node_id for reply in replies}
        for node_id, claim in sorted(self.partition_claims.items()):
            if claim != consensus and node_id in answered:
                log.warning(
                    "node %s reported num-partitions %d; most nodes report %d, which is used",
                    node_id,
                    claim,
                    consensus,
                )
        for reply in replies:
            self._identify(reply, refuse)
        missing = [
            n for n in unknown if n not in self.node_to_client and n not in self.refused_nodes
        ]
        if missing:
            log.warning("nodes without a known client id this round: %s", missing)

    @property
    def num_partitions(self) -> int:
        """The num-partitions most present nodes reported (ties: the smallest); 0: none."""
        counts = Counter(self.partition_claims.values())
        return max(counts, key=lambda n: (counts[n], -n)) if counts else 0

    def _count_partitions(self, reply: Message) -> None:
        """Keep the positive integer num-partitions an identity ``reply`` reports, if any."""
        if reply.has_error():
            return
        metrics = reply.content.metric_records.get(P.METRICS, MetricRecord())
        partitions = metrics.get(P.NUM_PARTITIONS)
        if isinstance(partitions, int) and partitions > 0:
            self.partition_claims[reply.metadata.src_node_id] = partitions
        elif partitions is not None:
            log.warning(
                "node %s reported num-partitions %r, not a count",
                reply.metadata.src_node_id,
                partitions,
            )

    def _identify(self, reply: Message, refuse: Callable[[int], str | None]) -> None:
        """Map the node of an identity ``reply`` to its client, or say why it is left out."""
        node_id = reply.metadata.src_node_id
        if reply.has_error():
            log.warning(
                "node %s did not answer the identity query: %s", node_id, reply.error.reason
            )
            return
        metrics = reply.content.metric_records.get(P.METRICS, MetricRecord())
        client_id = metrics.get(P.CLIENT_ID)
        if not isinstance(client_id, int):
            log.warning(
                "node %s answered the identity query without an integer client-id (%r)",
                node_id,
                client_id,
            )
            return
        partition = metrics.get(P.PARTITION_ID)
        if isinstance(partition, int) and partition >= 0:
            self.partition_of[client_id] = partition
        facts = reply.content.config_records.get(P.CONFIG, ConfigRecord())
        declared = str(facts.get(P.CAPABILITIES, ""))
        self.capabilities[client_id] = frozenset(c for c in declared.split(",") if c)
        refusal = refuse(client_id)
        if refusal is not None:
            log.warning("node %s is left out: %s", node_id, refusal)
            self.refused_nodes.add(node_id)
            return
        holder = next((n for n, c in self.node_to_client.items() if c == client_id), None)
        if holder is not None:
            log.warning(
                "two nodes claim client-id %s (node %s, node %s); ignoring node %s: give "
                "every SuperNode its own client-id",
                client_id,
                holder,
                node_id,
                node_id,
            )
            self.refused_nodes.add(node_id)
            return
        self.node_to_client[node_id] = client_id

    def clients(self) -> list[int]:
        """Client ids of the nodes currently connected and identified."""
        return sorted(self.node_to_client.values())

    def client_of(self, node_id: int) -> int | None:
        """The client id of ``node_id`` (None: not identified)."""
        return self.node_to_client.get(node_id)

    def nodes_by_client(self) -> dict[int, int]:
        """Client id -> its node id, for the identified clients."""
        return {c: n for n, c in self.node_to_client.items()}

    def holdings_of(self, client_id: int) -> tuple[str, ...]:
        """What ``client_id`` holds (its node config's ``capabilities``, else what the task's
        data gives it); empty: every component is its."""
        declared = self.capabilities.get(client_id)
        if declared:
            return tuple(sorted(declared))
        return self.client_holdings.get(self.data_key(client_id), ())

    def data_key(self, client_id: int) -> int:
        """The partition ``client_id``'s data are (what the task's per-client facts are keyed
        by); the client id itself until its node said, as in simulation where they agree."""
        return self.partition_of.get(client_id, client_id)
