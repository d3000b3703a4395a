"""Per-node messages: each node gets a new ``RecordDict`` with its own client's payload only.

A message's config is the caller's config plus ``server-round``, ``run-name``, ``client-id``
and ``phase``; its arrays are ``payload(client_id, server_round)``, so a client's personalized
tensors go to that client only. The ``arrays`` argument of Flower's ``configure_*`` is ignored:
the strategy owns its state. The tensors travel packed (``records.to_message_record``), those
alike for every client in a pack of their own, which the ServerApp pushes and the SuperLink
stores once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict

from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import to_message_record

Payload = Callable[[int, int], dict[str, torch.Tensor]]  # (client id, round) -> tensors


def per_node_messages(
    clients: list[int],
    server_round: int,
    message_type: str,
    payload: Payload,
    config: Mapping[str, Any],
    node_of: Mapping[int, int],
    run_name: str,
    phase: str,
) -> list[Message]:
    """One ``message_type`` message per client in ``clients``, to its node (``node_of``)."""
    payloads = {client_id: payload(client_id, server_round) for client_id in clients}
    shared = [alike(payloads.values())]
    messages = []
    for client_id in clients:
        record = ConfigRecord(dict(config))
        record[P.SERVER_ROUND] = server_round
        record[P.RUN_NAME] = run_name
        record[P.CLIENT_ID] = client_id
        record[P.PHASE] = phase
        content = RecordDict(
            {P.ARRAYS: to_message_record(payloads[client_id], shared), P.CONFIG: record}
        )
        messages.append(
            Message(
                content,
                dst_node_id=node_of[client_id],
                message_type=message_type,
                group_id=str(server_round),
            )
        )
    return messages


def alike(payloads: Iterable[Mapping[str, torch.Tensor]]) -> set[str]:
    """Names whose tensor is the same in every payload (same object, or equal shape, dtype and
    values): packed apart, they travel as one object for every client."""
    payloads = list(payloads)
    if not payloads:
        return set()
    first, rest = payloads[0], payloads[1:]
    return {
        name
        for name, tensor in first.items()
        if all(name in other and _same(tensor, other[name]) for other in rest)
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
