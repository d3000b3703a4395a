"""Names of the records and fields that travel between ServerApp and ClientApp.

Train and evaluate messages carry ``arrays`` (the parameters sent to that client only) and
``config`` (round, run name, and the client id the server believes the node has). Replies
carry ``arrays`` (what the method sends up) and ``metrics``; every reply states its stable
``client-id`` so strategies never key state by Flower's ephemeral node ids.

A *fused* training message (``fused-evaluation``) also carries the evaluation of an earlier round:
its config says ``evaluate-round`` = t, the client evaluates what round t's evaluate message
would have evaluated before it trains, and the reply adds ``evaluate-metrics`` (the evaluate
reply's metrics). A part that raised is reported in the reply's ``config`` as ``train-error`` or
``evaluate-error`` ("Type: message"), so the other part still counts.
"""

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"

SERVER_ROUND = "server-round"
RUN_NAME = "run-name"
CLIENT_ID = "client-id"
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
# Training reply: the client's data size, its aggregation weight; evaluate reply: test examples.
NUM_EXAMPLES = "num-examples"
EXAMPLES_SEEN = "examples-seen"  # training reply: examples the local loop trained on
TRAIN_LOSS = "train-loss"
TRAIN_SECONDS = "train-seconds"
STATE_ROUND = "state-round"  # round of the personal state a training reply started from (0: none)
STATE_DIGEST = "state-digest"  # client_state.state_digest of that state (0: none)
# Per-client facts that are not averaged into the round's mean/std metrics.
IDENTITY_METRICS = frozenset({CLIENT_ID, STATE_ROUND, STATE_DIGEST})
TEST_LOSS = "test-loss"
PHASE = "phase"  # config of a message: "train" (a federated round) or "post-training"
CAPABILITIES = "capabilities"  # query reply: comma-separated modalities/tasks a client has
EVALUATE_ROUND = "evaluate-round"  # config of a fused training message: the round to evaluate
EVALUATE_METRICS = "evaluate-metrics"  # fused training reply: the evaluation's metrics record
TRAIN_ERROR = "train-error"  # fused training reply config: why training failed ("Type: message")
EVALUATE_ERROR = "evaluate-error"  # fused training reply config: why the evaluation failed
# SecAgg+ training message (fedfm_flower.privacy.secagg): how the client weighs its masked
# update, "examples" (its num-examples) or "uniform" (1).
SECAGG_WEIGHTING = "secagg-weighting"
SECAGG_CLIPPED = "secagg-clipped"  # SecAgg+ training reply: update values beyond the range


def train_metric(name: str) -> str:
    """Reply metric name of a task's training statistic ``name`` (``train-<name>``)."""
    return f"train-{name}"


def test_metric(name: str) -> str:
    """Reply metric name of a task's evaluation metric ``name`` (``test-<name>``)."""
    return f"test-{name}"


UNSEEN = "unseen-"  # metric names of test-time tasks outside the federation


def unseen_metric(task: str, name: str) -> str:
    """A text task's metric ``name`` on test-time task ``task`` outside the federation
    (``unseen-<task>-<name>``; ``fedfm_flower.tasks.instructions``), replied as ``test-...``."""
    return f"{UNSEEN}{task}-{name}"


def unseen_task_of(key: str, name: str) -> str | None:
    """The unseen task of reply metric ``key`` when it is ``test_metric(unseen_metric(task,
    name))``, else None (their inverse)."""
    prefix, suffix = test_metric(UNSEEN), f"-{name}"
    task = key.removeprefix(prefix).removesuffix(suffix)
    return task if task and len(prefix) + len(task) + len(suffix) == len(key) else None
