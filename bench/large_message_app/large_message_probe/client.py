"""The probe's ClientApp: check the adapter as a strategy checks a reply, add 1, send it back."""

from __future__ import annotations

import time

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import decode_checked, tensor_spec, to_array_record
from large_message_probe.payload import adapter, peak_rss_mb

app = ClientApp()


@app.train()
def train(message: Message, context: Context) -> Message:
    """Decode the adapter against its declared spec, add 1 to every value, reply with it."""
    config = message.content.config_records[P.CONFIG]
    started = time.perf_counter()
    spec = tensor_spec(adapter(int(config["lora-rank"]), int(config["seed"])))
    tensors = decode_checked(message.content.array_records[P.ARRAYS], spec)
    decoded = time.perf_counter()
    reply = RecordDict(
        {
            P.ARRAYS: to_array_record({n: t + 1 for n, t in tensors.items()}),
            P.METRICS: MetricRecord(
                {
                    "decode-seconds": decoded - started,
                    "encode-seconds": time.perf_counter() - decoded,
                    "peak-rss-mb": peak_rss_mb(),
                }
            ),
            P.CONFIG: ConfigRecord({"node": str(context.node_id)}),
        }
    )
    return Message(reply, reply_to=message)
