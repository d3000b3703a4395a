"""What travelled in an in-process run: each training message's payload beside its reply."""

from __future__ import annotations

from typing import Any

import torch

from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import from_array_record

Traffic = dict[tuple[int, int], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def train_traffic(grid: Any, replies: list[tuple[int, Any]]) -> Traffic:
    """{(round, client): (received, sent)} of ``grid``'s training messages whose reply (among
    ``replies``, (client id, reply) as a reply hook saw them) holds arrays."""
    by_id = {m.metadata.message_id: m for m in grid.sent}
    traffic: Traffic = {}
    for client_id, reply in replies:
        message = by_id[reply.metadata.reply_to_message_id]
        if message.metadata.message_type != "train" or P.ARRAYS not in reply.content:
            continue
        received = from_array_record(message.content[P.ARRAYS])
        sent = from_array_record(reply.content[P.ARRAYS])
        traffic[(int(message.metadata.group_id), client_id)] = (received, sent)
    return traffic
