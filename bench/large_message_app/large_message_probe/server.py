"""The probe's ServerApp: the adapter to every node and back, checked exactly, timed."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import decode_checked, tensor_spec, to_array_record
from large_message_probe.payload import adapter, nbytes, peak_rss_mb
from server_apps.polling import PromptGrid

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Send, receive, check; write ``large_messages.json``; raise when an echo is wrong."""
    config = context.run_config
    rank, seed = int(config["lora-rank"]), int(config["seed"])
    nodes_wanted = int(config["num-clients"])
    run_dir = Path(str(config["output-dir"])) / str(config["run-name"])
    run_dir.mkdir(parents=True, exist_ok=True)
    grid = PromptGrid(grid)
    deadline = time.monotonic() + 120
    while len(list(grid.get_node_ids())) < nodes_wanted and time.monotonic() < deadline:
        time.sleep(0.2)
    nodes = sorted(grid.get_node_ids())[:nodes_wanted]
    tensors = adapter(rank, seed)
    started = time.perf_counter()
    record = to_array_record(tensors)
    encoded = time.perf_counter()
    messages = [
        Message(
            RecordDict(
                {P.ARRAYS: record, P.CONFIG: ConfigRecord({"lora-rank": rank, "seed": seed})}
            ),
            dst_node_id=node,
            message_type=MessageType.TRAIN,
        )
        for node in nodes
    ]
    replies = list(grid.send_and_receive(messages, timeout=float(config["round-timeout"])))
    received = time.perf_counter()
    spec = tensor_spec(tensors)
    clients = []
    for reply in replies:
        if reply.has_error():
            raise RuntimeError(f"node {reply.metadata.src_node_id}: {reply.error.reason}")
        echo = decode_checked(reply.content.array_records[P.ARRAYS], spec)
        wrong = [n for n, t in tensors.items() if not bool((echo[n] == t + 1).all())]
        if wrong:
            raise RuntimeError(f"node {reply.metadata.src_node_id}: wrong echo of {wrong[:3]}")
        clients.append(dict(reply.content.metric_records[P.METRICS]))
    checked = time.perf_counter()
    if len(replies) != len(nodes):
        raise RuntimeError(f"{len(replies)} of {len(nodes)} nodes replied")
    figures = {
        "nodes": len(nodes),
        "lora-rank": rank,
        "adapter-bytes": nbytes(tensors),
        "tensors": len(tensors),
        "encode-seconds": encoded - started,
        "round-trip-seconds": received - encoded,
        "decode-and-check-seconds": checked - received,
        "serverapp-peak-rss-mb": peak_rss_mb(),
        "clients": clients,
    }
    (run_dir / "large_messages.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"large messages: {json.dumps(figures)}; results in {run_dir}", flush=True)
