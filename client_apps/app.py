"""The one ClientApp of the Flower App: dispatches train/evaluate/query on the run's method.

Imports are lazy (torch, timm and peft load inside the handlers) because deployment starts a
fresh ``flwr-clientapp`` process for every message and pays the import time each time.
"""

from __future__ import annotations

import logging
import time

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedfm_flower import protocol as P

log = logging.getLogger(__name__)

app = ClientApp()


def _runtime_and_logic(message: Message, context: Context):  # noqa: ANN202
    from client_apps.base import ClientRuntime
    from fedfm_flower.registry import client_class

    config_record = message.content.config_records.get(P.CONFIG, ConfigRecord())
    run_name = str(config_record.get(P.RUN_NAME, ""))
    runtime = ClientRuntime.from_context(context, run_name)
    expected = config_record.get(P.CLIENT_ID)
    if expected is not None and int(expected) != runtime.identity.client_id:
        raise ValueError(
            f"server addressed client-id {expected} but this node is client-id "
            f"{runtime.identity.client_id}; the server will re-learn the node mapping"
        )
    server_round = int(config_record.get(P.SERVER_ROUND, 0))
    return runtime, client_class(runtime.config.method)(), server_round


def _received(message: Message) -> dict:
    from fedfm_flower.records import from_array_record

    record = message.content.array_records.get(P.ARRAYS, ArrayRecord())
    return from_array_record(record)


@app.train()
def train(message: Message, context: Context) -> Message:
    """Local training with this client's method; replies with what the method sends up.

    The reply also states which saved personal state training started from (``state-round``,
    ``state-digest``), so a restart's effect can be checked from the server's results.
    """
    from client_apps.faults import inject_fault, parse_faults
    from fedfm_flower.records import to_array_record

    started = time.perf_counter()
    runtime, logic, server_round = _runtime_and_logic(message, context)
    faults = parse_faults(context.node_config)  # before training: a bad value fails fast
    config_record = message.content.config_records.get(P.CONFIG, ConfigRecord())
    if config_record.get(P.PHASE, "train") == "post-training":
        sent, stats = logic.post_train(runtime, _received(message), server_round)
    else:
        sent, stats = logic.train(runtime, _received(message), server_round)
    metrics = MetricRecord(
        {
            P.CLIENT_ID: runtime.identity.client_id,
            P.NUM_EXAMPLES: stats.num_examples,
            P.TRAIN_LOSS: stats.loss,
            **{P.train_metric(k): v for k, v in stats.metrics.items()},
            P.TRAIN_SECONDS: time.perf_counter() - started,
            P.STATE_ROUND: runtime.store.loaded_round,
            P.STATE_DIGEST: runtime.store.loaded_digest,
        }
    )
    content = RecordDict({P.ARRAYS: to_array_record(sent), P.METRICS: metrics})
    if server_round in faults:
        log.warning("inject-fault: corrupting this reply (%s)", faults[server_round])
        content = inject_fault(content, faults[server_round])
    return Message(content=content, reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Evaluate the personalized model on this client's own test split."""
    runtime, logic, server_round = _runtime_and_logic(message, context)
    stats = logic.evaluate(runtime, _received(message), server_round)
    metrics = MetricRecord(
        {
            P.CLIENT_ID: runtime.identity.client_id,
            P.NUM_EXAMPLES: stats.num_examples,
            P.TEST_LOSS: stats.loss,
            **{P.test_metric(k): v for k, v in stats.metrics.items()},
        }
    )
    return Message(content=RecordDict({P.METRICS: metrics}), reply_to=message)


@app.query()
def query(message: Message, context: Context) -> Message:
    """Tell the server this node's stable client id and partition (no data is loaded)."""
    from fedfm_flower.config import ExperimentConfig, NodeIdentity

    config = ExperimentConfig.from_run_config(context.run_config)
    identity = NodeIdentity.from_node_config(context.node_config, config)
    metrics = MetricRecord(
        {
            P.CLIENT_ID: identity.client_id,
            P.PARTITION_ID: identity.partition_id,
            P.NUM_PARTITIONS: identity.num_partitions,
        }
    )
    # What this client holds (modalities, tasks), from its node config; TAP-style strategies
    # give components only to the clients that have them.
    facts = ConfigRecord({P.CAPABILITIES: str(context.node_config.get(P.CAPABILITIES, ""))})
    return Message(content=RecordDict({P.METRICS: metrics, P.CONFIG: facts}), reply_to=message)
