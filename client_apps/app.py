"""The one ClientApp of the Flower App: dispatches train/evaluate/query on the run's method.

* **train**: local training (``ClientLogic.train``), or a post-training round's work
  (``post_train``) when the message's phase says ``post-training``.
* **fused round** (``fused-evaluation``): a training message whose config names an
  ``evaluate-round`` t first evaluates round t (``ClientLogic.evaluate`` with round t's number:
  the client state as of round t, round t's seeds) on the received tensors, which are what round
  t's evaluate message would have carried, then trains; the reply holds the training reply's
  records plus ``evaluate-metrics``. An error in one part is reported in the reply's config and
  leaves the other part standing (``fused_reply``).
* **evaluate**: an evaluate-only message (clients due an evaluation but not sampled to train,
  and the final evaluation after the last round).
* **query**: the node's stable client id, partition and capabilities.

Imports are lazy (torch, timm and peft load inside the handlers) because deployment starts a
fresh ``flwr-clientapp`` process for every message and pays the import time each time. There
the ClientApp's inner mod, ``warm_worker_mod``, hands train and evaluate messages to the node's
long-lived worker process, which runs these same handlers with everything loaded
(``client_apps.warm``; node config ``warm-worker``). The outer mod, ``secagg_mod``, runs
SecAgg+'s client side on the messages of a ``secagg = true`` run (``client_apps.secagg``).

Imports inside functions keep ``torch`` out of this module's start-up.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_apps.secagg import secagg_mod
from client_apps.warm import warm_worker_mod
from fedfm_flower.config.experiment import ExperimentConfig, NodeIdentity
from fedfm_flower.methods import halves
from fedfm_flower.privacy import accountant
from fedfm_flower.records import protocol as P
from fedfm_flower.simulation import actor_preload, fork_engine, prompt_engine

if TYPE_CHECKING:
    import torch

    from client_apps.base import ClientLogic, ClientRuntime
    from fedfm_flower.tasks.training import EvalStats

log = logging.getLogger(__name__)

app = ClientApp(mods=[secagg_mod, warm_worker_mod])

# The simulation engine loads this module before it starts its threads and builds its actors:
# give it prompt hand-offs, and workers that import torch, timm and peft once, while the run
# starts (forked from one process on the CPU; Ray's actors, preloading, otherwise).
prompt_engine.install()
actor_preload.install()
fork_engine.install()


def _runtime_and_logic(message: Message, context: Context):  # noqa: ANN202
    from client_apps.base import ClientRuntime

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
    return runtime, halves.client_class(runtime.method.spec)(), server_round


def _received(message: Message) -> dict:
    from fedfm_flower.records.messages import from_array_record

    record = message.content.array_records.get(P.ARRAYS, ArrayRecord())
    return from_array_record(record)


@app.train()
def train(message: Message, context: Context) -> Message:
    """Local training with this client's method; replies with what the method sends up.

    The reply also states which saved personal state training started from (``state-round``,
    ``state-digest``), so a restart's effect can be checked from the server's results. Under a
    privacy mode (``dp`` or ``secagg``) the digest stays on the client: a fingerprint of the
    personal state would let whoever can retrain on candidate data tell which one it was. A fused
    message (``evaluate-round`` = t in its config) first evaluates round t on the received
    tensors, exactly as round t's evaluate message would have, then trains; see
    ``fused_reply``.
    """
    started = time.perf_counter()
    runtime, logic, _ = _runtime_and_logic(message, context)
    config_record = message.content.config_records.get(P.CONFIG, ConfigRecord())
    received = _received(message)
    if P.EVALUATE_ROUND in config_record:
        content = fused_reply(
            runtime, logic, context, config_record, received, int(config_record[P.EVALUATE_ROUND])
        )
    else:
        content = _train_content(runtime, logic, context, config_record, received, started)
    return Message(content=content, reply_to=message)


def fused_reply(
    runtime: ClientRuntime,
    logic: ClientLogic,
    context: Context,
    config_record: ConfigRecord,
    received: dict[str, torch.Tensor],
    evaluate_round: int,
) -> RecordDict:
    """Evaluate ``evaluate_round``, then train: the training reply plus ``evaluate-metrics``.

    The evaluation runs first, so it sees the client state as of ``evaluate_round`` (the methods
    look it up with ``at_most=evaluate_round``), and it uses that round's seeds. A part that
    raises is logged here and reported in the reply's config (``evaluate-error``,
    ``train-error``); the other part still counts, as with two separate messages.
    """
    errors: dict[str, str] = {}
    evaluation: MetricRecord | None = None
    started = time.perf_counter()
    try:
        evaluation = _evaluation_metrics(runtime, logic.evaluate(runtime, received, evaluate_round))
    except Exception as err:  # noqa: BLE001 - reported to the server; training still runs
        log.exception("evaluation of round %d failed", evaluate_round)
        errors[P.EVALUATE_ERROR] = f"{type(err).__name__}: {err}"
    runtime.store.forget_loaded()  # the reply states the state *training* started from
    training_started = time.perf_counter()
    try:
        content = _train_content(runtime, logic, context, config_record, received, training_started)
    except Exception as err:  # noqa: BLE001 - reported to the server; the evaluation counts
        log.exception("training failed")
        errors[P.TRAIN_ERROR] = f"{type(err).__name__}: {err}"
        content = RecordDict()
    if evaluation is not None:
        content[P.EVALUATE_METRICS] = evaluation
    if errors:
        content[P.CONFIG] = ConfigRecord(errors)
    log.debug("fused message: evaluation %.3fs", training_started - started)
    return content


def _train_content(
    runtime: ClientRuntime,
    logic: ClientLogic,
    context: Context,
    config_record: ConfigRecord,
    received: dict[str, torch.Tensor],
    started: float,
) -> RecordDict:
    """The training (or post-training) reply's records, faults injected where configured."""
    from client_apps.faults import (
        FAULT_KINDS,
        hold_until_released,
        inject_fault,
        parse_faults,
        stall_state_write,
    )
    from fedfm_flower.records.messages import to_message_record

    server_round = int(config_record.get(P.SERVER_ROUND, 0))
    faults = parse_faults(context.node_config)  # before training: a bad value fails fast
    if faults.get(server_round) == "stall-save":
        stall_state_write(runtime.store)
    if faults.get(server_round) == "hold":
        hold_until_released(runtime.store.directory)
    if config_record.get(P.PHASE, "train") == "post-training":
        sent, stats = logic.post_train(runtime, received, server_round)
        if sent and runtime.config.dp != "none":  # no mechanism covers it (MethodSpec.capabilities)
            raise RuntimeError(
                f"method {runtime.config.method!r} sends {len(sent)} tensors in its post-training "
                f"round, which dp = {runtime.config.dp!r} does not cover; its capabilities must "
                "refuse dp"
            )
    else:
        sent, stats = logic.train(runtime, received, server_round)
        sent = _privatized(runtime, logic, sent, received)
    metrics = MetricRecord(
        {
            P.CLIENT_ID: runtime.identity.client_id,
            P.NUM_EXAMPLES: logic.data_size(runtime),
            P.EXAMPLES_SEEN: stats.examples_seen,
            P.TRAIN_LOSS: stats.loss,
            **{P.train_metric(k): v for k, v in stats.metrics.items()},
            P.TRAIN_SECONDS: time.perf_counter() - started,
            P.STATE_ROUND: runtime.store.loaded_round,
        }
    )
    if runtime.config.dp == "none" and not runtime.config.secagg:
        metrics[P.STATE_DIGEST] = runtime.store.loaded_digest
    content = RecordDict({P.ARRAYS: to_message_record(sent), P.METRICS: metrics})
    if faults.get(server_round) in FAULT_KINDS:
        log.warning("inject-fault: corrupting this reply (%s)", faults[server_round])
        content = inject_fault(content, faults[server_round])
    return content


def _privatized(
    runtime: ClientRuntime,
    logic: ClientLogic,
    sent: dict[str, torch.Tensor],
    received: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """``sent`` as it may leave the client under ``dp`` (``fedfm_flower.privacy``): the update
    clipped (central), or clipped and noised with fresh noise no one can regenerate (local)."""
    config = runtime.config
    if config.dp == "none":
        return sent
    import torch

    from fedfm_flower.privacy import mechanism

    base = {n: torch.zeros_like(t) for n, t in sent.items()} if logic.sends_updates else received
    if config.dp == "central":
        return mechanism.clip_update(sent, base, config.dp_clipping_norm)
    sigma = accountant.noise_multiplier(config)
    return mechanism.privatize_locally(sent, base, config.dp_clipping_norm, sigma)


def _evaluation_metrics(runtime: ClientRuntime, stats: EvalStats) -> MetricRecord:
    """An evaluate reply's metrics: identity, example count, loss and the task's metrics."""
    return MetricRecord(
        {
            P.CLIENT_ID: runtime.identity.client_id,
            P.NUM_EXAMPLES: stats.num_examples,
            P.TEST_LOSS: stats.loss,
            **{P.test_metric(k): v for k, v in stats.metrics.items()},
        }
    )


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Evaluate the personalized model on this client's own test split."""
    runtime, logic, server_round = _runtime_and_logic(message, context)
    stats = logic.evaluate(runtime, _received(message), server_round)
    metrics = _evaluation_metrics(runtime, stats)
    return Message(content=RecordDict({P.METRICS: metrics}), reply_to=message)


@app.query()
def query(message: Message, context: Context) -> Message:
    """Tell the server this node's stable client id and partition (no data is loaded)."""

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
