"""Per-node messages: each node gets a new ``RecordDict`` with its own client's payload only.

A message's config is the caller's config plus ``server-round``, ``run-name``, ``client-id``
and ``phase``; its arrays are ``payload(client_id, server_round)``, so a client's personalized
tensors go to that client only. The ``arrays`` argument of Flower's ``configure_*`` is ignored:
the strategy owns its state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, RecordDict

from fedfm_flower import protocol as P
from fedfm_flower.records import to_array_record

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
    messages = []
    for client_id in clients:
        record = ConfigRecord(dict(config))
        record[P.SERVER_ROUND] = server_round
        record[P.RUN_NAME] = run_name
        record[P.CLIENT_ID] = client_id
        record[P.PHASE] = phase
        content = RecordDict(
            {P.ARRAYS: to_array_record(payload(client_id, server_round)), P.CONFIG: record}
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
