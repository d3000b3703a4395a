"""The ClientApp's SecAgg+ mod: Flower's ``secaggplus_mod``, fed our update and weight.

A training message with a ``secaggplus`` record (``fedfm_flower.privacy.secagg``) goes to
Flower's mod, unchanged; its key stages answer by themselves, and in the masked-vector stage it
calls the ClientApp through ``_reply_as_fitres``, which trains and hands the mod what Flower's
legacy ``FitRes`` holds: the *update* (trained - received shared tensors, in sorted name
order) and the weight (``num-examples``, or ``secagg-max-weight`` for every client where the
server weighs clients uniformly). The mod
masks them into its reply and empties the reply's arrays; the legacy records are removed, so
the reply keeps only its metrics and the masked vector. Any other message passes through.

A training step that fails (an error reply, or ``train-error`` in a fused reply) raises here,
so the node drops out of the round's sum and the server removes its masks (SecAgg+'s dropout
path); a fused reply's evaluation is then lost with it.

Imports inside functions keep ``flwr.client``, ``flwr.common`` and ``torch`` out of this
module's start-up.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord
from flwr.clientapp.typing import ClientAppCallable
from flwr.compat.common.recorddict_compat import fitres_to_recorddict

from fedfm_flower.privacy.secagg import SECAGG_RECORD
from fedfm_flower.records import protocol as P

LEGACY_PREFIX = "fitres."


def secagg_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Run SecAgg+'s client side on a SecAgg+ training message; pass anything else on."""
    content = message.content
    if (
        message.metadata.message_type != MessageType.TRAIN
        or SECAGG_RECORD not in content.config_records
    ):
        return call_next(message, context)
    from flwr.client.mod import secaggplus_mod

    from fedfm_flower.records.messages import numpy_arrays

    received = numpy_arrays(content.array_records.get(P.ARRAYS, ArrayRecord()))

    def reply_as_fitres(inner: Message, inner_context: Context) -> Message:
        reply = call_next(inner, inner_context)
        return _reply_as_fitres(reply, received, inner, _protocol_state(inner_context))

    reply = secaggplus_mod(message, context, reply_as_fitres)
    for name in [n for n in reply.content if n.startswith(LEGACY_PREFIX)]:
        del reply.content[name]
    return reply


def _protocol_state(context: Context) -> ConfigRecord:
    """The SecAgg+ state Flower's mod keeps in the node's context (set at its setup stage)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE

    return context.state.config_records[RECORD_KEY_STATE]


def _reply_as_fitres(
    reply: Message, received: dict[str, np.ndarray], sent: Message, state: ConfigRecord
) -> Message:
    """``reply`` plus the legacy ``fitres.*`` records Flower's mod reads: the update and weight;
    the count of weighted update values beyond the clipping range (what the mod clips) in the
    reply's metrics."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

    from fedfm_flower.records.messages import numpy_arrays

    if reply.has_error():
        raise RuntimeError(f"training failed: {reply.error.reason}")
    content = reply.content
    config = content.config_records.get(P.CONFIG, ConfigRecord())
    if P.TRAIN_ERROR in config:
        raise RuntimeError(f"training failed: {config[P.TRAIN_ERROR]}")
    trained = numpy_arrays(content.array_records.get(P.ARRAYS, ArrayRecord()))
    if set(trained) != set(received):
        raise ValueError(
            f"SecAgg+ needs the reply to hold the received tensors: sent {sorted(received)}, "
            f"reply holds {sorted(trained)}"
        )
    names = sorted(received)
    updates = [trained[n].astype(np.float64) - received[n].astype(np.float64) for n in names]
    metrics = content.metric_records[P.METRICS]
    sent_config = sent.content.config_records.get(P.CONFIG, ConfigRecord())
    equal = sent_config.get(P.SECAGG_WEIGHTING, "examples") == "uniform"
    # Uniform: every client at the largest weight, so w / max-weight = 1 and the quantization
    # is as fine as it gets (a weight common to all clients cancels in the mean).
    weight = int(float(state["max_weight"])) if equal else int(metrics[P.NUM_EXAMPLES])
    if weight > float(state["max_weight"]):
        raise ValueError(
            f"this client's weight {weight} (num-examples) exceeds secagg-max-weight = "
            f"{state['max_weight']}; raise secagg-max-weight"
        )
    # Flower's mod clips the *weighted* update (w / max-weight, quantized as it does) to the
    # range: count what it will clip, not the raw update's values beyond it.
    target = int(state["target_range"])
    ratio = round(weight / float(state["max_weight"]) * target) / target
    bound = float(state["clipping_range"])
    clipped = sum(int(np.count_nonzero(np.abs(u * ratio) > bound)) for u in updates)
    content.metric_records[P.METRICS] = MetricRecord({**dict(metrics), P.SECAGG_CLIPPED: clipped})
    legacy = fitres_to_recorddict(
        FitRes(Status(Code.OK, ""), ndarrays_to_parameters(updates), weight, {}), keep_input=False
    )
    for name, record in legacy.items():
        content[name] = record
    return reply
