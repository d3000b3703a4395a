"""ClientApps for tests/test_fork_engine.py: a forked worker imports this module by name."""

from __future__ import annotations

import os

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(message: Message, context: Context) -> Message:
    """Reply with what the worker saw; count the calls in the node's state; fail on demand."""
    what = str(message.content["config"]["do"])
    if what == "raise":
        raise ValueError("asked to fail")
    if what == "die":
        os._exit(7)
    calls = int(context.state.config_records.get("seen", ConfigRecord({"n": 0}))["n"]) + 1
    context.state["seen"] = ConfigRecord({"n": calls})
    reply = {
        "pid": os.getpid(),
        "calls": calls,
        "omp": os.environ.get("OMP_NUM_THREADS", ""),
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
        "value": float(message.content["config"]["value"]) * 2,
    }
    if what == "wait":
        marker = str(message.content["config"]["marker"])
        open(marker + ".started", "w").close()
        while not os.path.exists(marker + ".go"):
            pass
    return Message(RecordDict({"out": ConfigRecord(reply)}), reply_to=message)
