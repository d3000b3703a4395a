"""What travelled in an in-process run: each training message's payload beside its reply, and
the checks of a reply under local DP."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import from_array_record

Tensors = dict[str, torch.Tensor]
Traffic = dict[tuple[int, int], tuple[Tensors, Tensors]]


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


def run_recording(run_config: Mapping[str, Any], num_nodes: int) -> tuple[dict[str, Any], Traffic]:
    """Run in process; (summary, the training traffic)."""
    from server_apps.inprocess import run_in_process

    replies: list[tuple[int, Any]] = []
    summary, grid = run_in_process(run_config, num_nodes, lambda c, r: replies.append((c, r)) or r)
    return summary, train_traffic(grid, replies)


def local_dp(clip: float, sigma: float) -> dict[str, Any]:
    """Run-config keys of local DP at clipping norm ``clip`` and noise multiplier ``sigma``."""
    return {"dp": "local", "dp-clipping-norm": clip, "dp-noise-multiplier": sigma}


def assert_locally_noised(
    sent: Tensors, received: Tensors, draws: list[Tensors], clip: float, sigma: float
) -> None:
    """``sent`` is ``received`` plus an update within ``clip`` plus exactly one of ``draws``
    (the client's own noise; any other leaves it far from ``received``), whose values have std
    ``sigma * clip``."""
    assert set(sent) == set(received)

    def update_norm(noise: Tensors) -> float:
        return math.sqrt(
            sum(
                float((sent[n].double() - noise[n] - received[n].double()).pow(2).sum())
                for n in sent
            )
        )

    own = [d for d in draws if set(d) == set(sent) and update_norm(d) <= clip * (1 + 1e-4)]
    assert len(own) == 1, f"{len(own)} draws bring the reply within C of what it received"
    std = float(torch.cat([own[0][n].flatten() for n in sorted(sent)]).std())
    assert abs(std / (sigma * clip) - 1) < 0.1, (std, sigma * clip)
