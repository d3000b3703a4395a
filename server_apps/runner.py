"""The round loop shared by every method: Flower's Strategy calls plus what research runs need.

Compared with ``Strategy.start`` this loop also learns the node-to-client mapping before each
round, evaluates every ``eval-every`` rounds (and after the last), counts bytes both ways,
appends a JSON line per round, checkpoints the strategy after every round, resumes from the
newest intact checkpoint with ``resume=true``, and prints a progress line with the task's
primary metric, bytes, time and ETA. A strategy's post-training rounds follow the last
federated round and are run, recorded and checkpointed the same way.

**Fused rounds** (``fused-evaluation = true``, where the strategy's ``fuses_evaluation()``
allows it): a round costs one phase of messages, not two. Round t's evaluation rides on round
t + 1's training messages; each evaluated client evaluates, before it trains, exactly what round
t's evaluate message would have carried, with round t's client state and seeds, so the results
are bit-identical to the two-phase loop. Clients due the evaluation but not sampled to train get
round t's evaluate message in round t + 1's phase; the last round (federated or post-training)
is evaluated in a phase of its own, as is a round whose training had no usable reply (its
failure is decided at once, as in the two-phase loop). Round t's line in ``metrics.jsonl`` is
appended and its checkpoint written when its training is aggregated, the checkpoint marked
``evaluation-pending``; the line is rewritten with the evaluation when round t + 1's replies
bring it. A crash in between loses nothing: ``resume=true`` finds the mark and carries round t's
evaluation on round t + 1's messages again (in a phase of its own if the resumed run does not
fuse). The evaluation's bytes are round t's (only evaluate-only messages carry a payload for
it); its time is in round t + 1's ``round-seconds``. The progress line of round t + 1 shows
round t's metric as ``acc@t``.

A run fails loudly instead of reporting stale numbers:

* at start, when a client holds fewer examples than ``min-train-examples``/``min-test-examples``
  (``fedfm_flower.data.sizes``);
* when more than ``max-failed-rounds`` consecutive rounds fail, a round failing when no client
  returns a usable training reply or, when evaluation is due, no usable evaluation reply;
* when the last round's evaluation has no usable reply (there is no final result to report).

``RunFailed`` then ends the ServerApp, so Flower marks the run failed and the launchers exit
non-zero. The failing round's record is appended to ``metrics.jsonl`` (with ``failed``) but not
checkpointed, ``failure.json`` in the run directory says why, and ``resume=true`` repeats the
round once the cause is fixed. A fused round's evaluation failure is known one phase later,
after the round was checkpointed: its line is rewritten with ``failed``, and ``resume=true``
repeats its evaluation (its training was complete).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import platform
import time
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid

from fedfm_flower import __version__
from fedfm_flower.config.experiment import ExperimentConfig
from fedfm_flower.data import check_client_sizes
from fedfm_flower.methods.halves import strategy_class
from fedfm_flower.methods.registry import resolve
from fedfm_flower.models import initial_trainable
from fedfm_flower.models.build import prepare_foundation
from fedfm_flower.models.foundation_cards import describe, model_difference
from fedfm_flower.privacy.accountant import privacy_spent
from fedfm_flower.privacy.ledger import LedgerFile
from fedfm_flower.records import protocol as P
from fedfm_flower.records.messages import record_dict_nbytes
from fedfm_flower.records.results import CLIENT_PARTITIONS, RunDirectory, progress_line
from fedfm_flower.records.trackers.run import Trackers, open_trackers
from fedfm_flower.simulation.waits import GrowingWait
from fedfm_flower.tasks import task_of
from strategies.base import PersonalizedStrategy
from strategies.parts.context import NO_CONTEXT, RunContext
from strategies.parts.outcome import PhaseOutcome

if TYPE_CHECKING:
    from fedfm_flower.records.trackers.run import Trackers

log = logging.getLogger("fedfm_flower")

# Called with (round, mean validation value) when a round's evaluation is complete; True stops
# the run after that round (a tuning trial's pruner: ``fedfm_flower.study.pruning``).
EarlyStop = Callable[[int, float], bool]

NODE_WAIT_FIRST_S, NODE_WAIT_LONGEST_S = 0.05, 1.0  # growing looks for the nodes at launch
MAX_REASONS = 3  # rejection reasons quoted in a failure message


class RunFailed(RuntimeError):
    """The run cannot produce trustworthy results; the message says why and how to go on."""


def build_strategy(
    config: ExperimentConfig, context: RunContext = NO_CONTEXT
) -> PersonalizedStrategy:
    """The configured method's strategy for the run ``context``, initialised from the seeded
    trainable tensors; the method is resolved here once (unless ``context`` brings it) and
    given to the strategy with the context."""

    method = context.method or resolve(config)
    outputs = task_of(config).num_outputs(config)
    initial = initial_trainable(
        config, method.tuner, outputs, train_backbone=method.trains_backbone
    )
    context = dataclasses.replace(context, method=method)
    return strategy_class(method.spec)(config, initial, context)


def wait_for_nodes(grid: Grid, config: ExperimentConfig) -> list[int]:
    """Wait until ``num-clients`` nodes (or at least one, when 0) are connected."""
    wanted = max(config.num_clients, 1)
    deadline = time.monotonic() + config.round_timeout
    pauses = GrowingWait(NODE_WAIT_FIRST_S, NODE_WAIT_LONGEST_S)
    while True:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= wanted or time.monotonic() > deadline:
            break
        time.sleep(next(pauses))
    if len(nodes) < wanted:
        log.warning(
            "only %d of %d nodes connected after %.0fs; starting anyway",
            len(nodes),
            wanted,
            config.round_timeout,
        )
    if not nodes:
        raise RuntimeError("no SuperNode connected; start SuperNodes or check the federation")
    return nodes


def run_experiment(
    grid: Grid, config: ExperimentConfig, early_stop: EarlyStop | None = None
) -> dict[str, Any]:
    """Run (or resume) the experiment described by ``config``; returns the summary.

    ``early_stop`` gets each evaluated round's mean primary metric as its evaluation completes;
    when it answers True the run ends after that round's checkpoint and its summary says
    ``stopped-at-round`` (a pruned tuning trial). Any exception is also recorded in the run
    directory's ``failure.json`` before it propagates.
    """

    run = RunDirectory.open(config)
    trackers, failed = Trackers({}), True
    try:
        trackers = open_trackers(config, run.path, run.name)
        summary = _run(grid, config, run, trackers, early_stop)
        failed = False
        return summary
    except Exception as err:
        records = run.rounds()  # a failed round is recorded too, marked "failed"
        run.write_failure(
            {
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(),
                "rounds-completed": sum("failed" not in r for r in records),
                "rounds-failed": [r["round"] for r in records if "failed" in r],
            }
        )
        log.error("run %s failed: %s", run.name, err)
        raise
    finally:
        trackers.close(failed)


def _refuse_another_foundation(run: RunDirectory, card: dict[str, Any]) -> None:
    """A ``ValueError`` when the run to resume recorded another foundation model than the one
    this command loads (a changed recipe, another build in the cache): its rounds so far trained
    on the recorded one, and going on from them on another would mix two models in one run."""
    recorded = run.recorded_foundation()
    what = model_difference(recorded, card)
    if what:
        raise ValueError(
            f"run {run.name} cannot resume: its rounds so far and this command would use {what}: "
            f"recorded {describe(recorded)}, now {describe(card)}. Put the recorded build back "
            "in the cache (a tuning study keeps its builds: docs/tuning.md) or start the run "
            "over under another run-name; its checkpoints and rounds are as they were"
        )


def _run(
    grid: Grid,
    config: ExperimentConfig,
    run: RunDirectory,
    trackers: Trackers,
    early_stop: EarlyStop | None = None,
) -> dict[str, Any]:
    card = prepare_foundation(config)
    nodes = wait_for_nodes(grid, config)
    client_examples = check_partitions(config, config.num_clients or len(nodes))
    task = task_of(config)
    client_tasks = task.client_labels(config, len(client_examples))
    holdings = task.client_holdings(config, len(client_examples))
    context = RunContext(
        run_name=run.name,
        client_tasks={int(c): label for c, label in client_tasks.items()},
        client_holdings={int(c): tuple(held) for c, held in holdings.items()},
        method=resolve(config),
    )
    strategy = build_strategy(config, context)
    start_round = 1
    pending: dict[str, Any] | None = None  # the record whose evaluation rides on the next round
    if config.resume:
        _refuse_another_foundation(run, card)
        run.clear_failure()
        newest = run.load_newest_checkpoint()
        if newest is None:
            log.warning("resume=true but %s has no checkpoint; starting at round 1", run.name)
        else:
            done, tensors, meta = newest
            strategy.load_state_dict(tensors, meta["strategy"])
            start_round = done + 1
            log.info("resuming %s after round %d", run.name, done)
        run.truncate_rounds(start_round - 1)
        if newest is not None and newest[2].get(EVALUATION_PENDING):
            pending = awaiting_evaluation(run.rounds(), start_round - 1)
    releases, ledger_file = strategy.releases, None  # the DP release ledger (None: no DP)
    if releases is not None:  # releases after the newest checkpoint count too
        ledger_file = LedgerFile(run.path)
        written = ledger_file.read(releases.mode)
        if written is not None:
            releases.absorb(written)
    run.write_config(
        config,
        {
            "foundation": card,
            "client-examples": client_examples,
            "client-tasks": client_tasks,
            "client-domains": task.client_domains(config, len(client_examples)),
            "fedfm-flower": __version__,
            "python": platform.python_version(),
        },
    )
    total = config.num_server_rounds + strategy.post_training_rounds()
    primary = task_of(config).primary_metric
    fused = config.fused_evaluation and strategy.fuses_evaluation()
    log.info(
        "run %s: method %s, %d rounds (%d post-training), %s, results in %s",
        run.name,
        config.method,
        total,
        total - config.num_server_rounds,
        "evaluation fused into the next round's messages"
        if fused
        else "evaluation in a phase of its own",
        run.path,
    )
    started = time.perf_counter()
    round_times: list[float] = [r["round-seconds"] for r in run.rounds()]
    ledger = FailureLedger(run, config, trackers)
    stopped_at = None  # the evaluated round on which early_stop ended the run
    if pending is not None and (not fused or start_round > total):
        evaluate_alone(grid, strategy, config, pending)  # a fused run resumed without fusing
        ledger.complete(pending)
        pending = None
    for server_round in range(start_round, total + 1):
        last = server_round == total
        carried, pending = pending, None
        record = run_round(grid, strategy, config, server_round, last, carried, fused, ledger_file)
        round_times.append(record["round-seconds"])
        if carried is not None:
            ledger.complete(carried)  # may raise RunFailed: its evaluation had no usable reply
        if awaits_evaluation(record, config, last):
            pending = record  # its evaluation comes with the next round's replies
        else:
            ledger.settle(record, last)  # may raise RunFailed (after recording the round)
        run.append_round(record)
        if pending is None:
            trackers.log_round(record)
        tensors, meta = strategy.state_dict()
        run.save_checkpoint(
            server_round,
            tensors,
            {"strategy": meta, EVALUATION_PENDING: pending is not None},
            config.keep_checkpoints,
        )
        remaining = total - server_round
        recent = round_times[-5:]
        eta = remaining * sum(recent) / len(recent)
        shown = record if "evaluate" in record or carried is None else carried
        print(progress_line(record, total, eta, primary, shown), flush=True)
        stopped_at = _stops_early(early_stop, (carried, record), primary)
        if stopped_at is not None and not last:  # the last round is reported, not stopped
            log.info("run %s stopped early after round %d", run.name, server_round)
            break
        stopped_at = None
    summary = summarize(run, config, time.perf_counter() - started)
    if stopped_at is not None:
        summary["stopped-at-round"] = stopped_at
    summary["client-examples"] = client_examples
    partition_of = strategy.nodes.partition_of  # client id -> partition, as the nodes reported
    if partition_of:
        summary[CLIENT_PARTITIONS] = {str(c): p for c, p in sorted(partition_of.items())}
    run.write_summary(summary)
    trackers.log_summary(summary)
    split = "" if config.evaluation_split == "test" else "validation "
    print(
        f"[done] {run.name}: final {split}{primary} "
        f"{summary[f'final-test-{primary}-mean']:.4f} ± "
        f"{summary[f'final-test-{primary}-std']:.4f}; results in {run.path}",
        flush=True,
    )
    return summary


def _stops_early(
    early_stop: EarlyStop | None, records: Iterable[dict[str, Any] | None], primary: str
) -> int | None:
    """Give ``early_stop`` each of ``records`` (in round order) whose evaluation is complete;
    the first round it answers True for, or None."""
    if early_stop is None:
        return None
    key = f"{P.test_metric(primary)}-mean"
    stopped = None
    for record in records:
        if record is None or "failed" in record or key not in record:
            continue
        if early_stop(record["round"], float(record[key])) and stopped is None:
            stopped = int(record["round"])
    return stopped


EVALUATION_PENDING = "evaluation-pending"  # checkpoint mark: the round's evaluation is not in yet


class FailureLedger:
    """Counts failed rounds in a row, in round order, and stops the run past the limit."""

    def __init__(self, run: RunDirectory, config: ExperimentConfig, trackers: Trackers) -> None:
        self.run = run
        self.config = config
        self.trackers = trackers
        self.failed_in_a_row = 0

    def settle(self, record: dict[str, Any], last: bool, written: bool = False) -> None:
        """Mark ``record`` failed or not (it is complete); raise ``RunFailed`` after recording
        it (appended, or rewritten when ``written``) when the run cannot go on."""
        problem = round_failure(record)
        self.failed_in_a_row = self.failed_in_a_row + 1 if problem else 0
        record.pop("failed", None)
        if problem:
            record["failed"] = problem
            log.warning("round %d failed: %s", record["round"], problem)
        no_final_result = last and record.get("evaluate") == {}
        if problem and (self.failed_in_a_row > self.config.max_failed_rounds or no_final_result):
            if written:
                self.run.replace_round(record)
            else:
                self.run.append_round(record)  # for the record; not checkpointed
            why = (
                "the last round has no evaluation"
                if no_final_result
                else f"{self.failed_in_a_row} failed round(s) in a row, "
                f"max-failed-rounds = {self.config.max_failed_rounds}"
            )
            raise RunFailed(
                f"round {record['round']}: {problem}; {why}. Fix the cause, then continue with "
                f"resume=true run-name='{self.run.name}'"
            )

    def complete(self, record: dict[str, Any]) -> None:
        """A written round's evaluation came in: settle it and rewrite its line."""
        self.settle(record, last=False, written=True)
        self.run.replace_round(record)
        self.trackers.log_round(record)


def evaluation_due(server_round: int, config: ExperimentConfig, last: bool) -> bool:
    """Whether ``server_round`` is evaluated: every ``eval-every`` rounds and after the last."""
    return server_round % config.eval_every == 0 or last


def awaits_evaluation(record: dict[str, Any], config: ExperimentConfig, last: bool) -> bool:
    """Whether ``record``'s evaluation is due but has not come in (it rides on the next
    round's messages)."""
    return evaluation_due(record["round"], config, last) and "evaluate" not in record


def awaiting_evaluation(rounds: list[dict[str, Any]], server_round: int) -> dict[str, Any] | None:
    """The record of ``server_round`` when its evaluation is still to come (a checkpoint
    marked ``evaluation-pending``): not written yet, or written without a usable reply."""
    record = next((r for r in rounds if r["round"] == server_round), None)
    if record is None or ("evaluate" in record and "failed" not in record):
        return None
    return record


def check_partitions(config: ExperimentConfig, num_clients: int) -> dict[str, dict[str, int]]:
    """Every client's example counts by client id; fails when one is below the minimum."""

    counts = check_client_sizes(config, task_of(config).example_counts(config, num_clients))
    return {str(client): c.as_dict() for client, c in enumerate(counts)}


def round_failure(record: dict[str, Any]) -> str:
    """Why the round in ``record`` failed ('' when it did not): no usable reply in a phase."""
    problems = []
    for phase, accepted, rejected, missing in (
        ("training", record["train"], record["rejected"], record["missing"]),
        (
            "evaluation",
            record.get("evaluate"),
            record.get("evaluate-rejected", {}),
            record.get("evaluate-missing", []),
        ),
    ):
        if accepted is None or accepted:  # not due, or someone replied
            continue
        by_reason: dict[str, list[str]] = {}
        for client, why in sorted(rejected.items()):
            by_reason.setdefault(why, []).append(client)
        reasons = [
            f"client{'s' if len(cs) > 1 else ''} {', '.join(cs)}: {why}"
            for why, cs in list(by_reason.items())[:MAX_REASONS]
        ]
        if len(by_reason) > MAX_REASONS:
            reasons.append(f"{len(by_reason) - MAX_REASONS} other reasons")
        if missing:
            reasons.append(f"no reply from {missing}")
        detail = "; ".join(reasons) or "no client was sampled"
        problems.append(f"no client returned a usable {phase} reply ({detail})")
    return " and ".join(problems)


def run_round(
    grid: Grid,
    strategy: PersonalizedStrategy,
    config: ExperimentConfig,
    server_round: int,
    last: bool = False,
    carried: dict[str, Any] | None = None,
    fused: bool = False,
    ledger: LedgerFile | None = None,
) -> dict[str, Any]:
    """One training (or post-training) round, plus evaluation when due or ``last``; returns the
    round's record.

    ``carried``, the record of an earlier round whose evaluation is still to come, gets it from
    this round's phase (fused into the training messages). With ``fused`` this round's own
    evaluation is left to the next round (the record has no ``evaluate``), unless ``last`` or
    no training reply was usable. Under DP, ``ledger`` receives the strategy's releases before
    any message that may carry one goes out. The replies come back by the strategy's exchange
    (plain, or SecAgg+: its own traffic is recorded as the exchange names it).
    """
    started = time.perf_counter()
    evaluate_round = carried["round"] if carried is not None else None
    messages = strategy.configure_round(server_round, evaluate_round, grid)
    if ledger is not None:  # local DP: the clients release when they answer these
        ledger.keep(strategy.releases)
    server_seconds = time.perf_counter() - started
    bytes_down, carried_down = _split_bytes(messages)
    exchanged = strategy.exchange(grid, messages, server_round)
    bytes_up, carried_up = _split_bytes(r for r in exchanged.replies if not r.has_error())
    aggregate_started = time.perf_counter()
    outcome = strategy.aggregate_round(server_round, evaluate_round, exchanged)
    if ledger is not None:  # central DP: the noised average leaves with the next messages
        ledger.keep(strategy.releases)
    aggregate_seconds = time.perf_counter() - aggregate_started
    server_seconds += aggregate_seconds
    if carried is not None and outcome.evaluation is not None:  # evaluate_round's evaluation
        _record_evaluation(carried, outcome.evaluation)
        _record_bytes(carried, carried_down, carried_up)
    trained = outcome.train.report
    record: dict[str, Any] = {
        "round": server_round,
        "phase": strategy.phase(server_round),
        "clients-sampled": len(trained.sent),
        "sampled": list(trained.sent),
        "clients-reported": len(trained.accepted),
        "train": {str(c): m for c, m in trained.accepted.items()},
        "rejected": dict(trained.rejected),
        "missing": trained.missing,
        "bytes-down-train": bytes_down,
        "bytes-up-train": bytes_up,
        "aggregate-seconds": aggregate_seconds,
        **exchanged.traffic,  # the exchange's own bytes (SecAgg+'s: bytes-{down,up}-secagg)
        "server": dict(outcome.server_metrics),
    }
    record.update(_means(outcome.train.metrics, "train-", ("-mean",)))
    eval_down = eval_up = 0
    later = fused and not last and bool(record["train"])  # on the next round's messages
    if evaluation_due(server_round, config, last) and not later:
        configure_started = time.perf_counter()
        messages = list(
            strategy.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(), grid)
        )
        server_seconds += time.perf_counter() - configure_started
        eval_down = sum(record_dict_nbytes(m.content) for m in messages)
        replies = list(grid.send_and_receive(messages, timeout=config.round_timeout))
        eval_up = sum(record_dict_nbytes(r.content) for r in replies if not r.has_error())
        aggregate_started = time.perf_counter()
        evaluation = strategy.aggregate_evaluation(server_round, replies)
        server_seconds += time.perf_counter() - aggregate_started
        _record_evaluation(record, evaluation)
    _record_bytes(record, eval_down, eval_up)
    # The strategy's own work (building messages, validating and aggregating replies), without
    # waiting for clients; configure_* includes the node-mapping query when nodes are new.
    record["server-seconds"] = server_seconds
    record["round-seconds"] = time.perf_counter() - started
    return record


def evaluate_alone(
    grid: Grid, strategy: PersonalizedStrategy, config: ExperimentConfig, record: dict[str, Any]
) -> None:
    """Evaluate ``record``'s round in a phase of its own (the strategy holds the state after
    that round) and add the evaluation to the record."""
    server_round = record["round"]
    messages = list(strategy.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(), grid))
    replies = list(grid.send_and_receive(messages, timeout=config.round_timeout))
    _record_evaluation(record, strategy.aggregate_evaluation(server_round, replies))
    _record_bytes(
        record,
        sum(record_dict_nbytes(m.content) for m in messages),
        sum(record_dict_nbytes(r.content) for r in replies if not r.has_error()),
    )


def _split_bytes(messages: Iterable[Message]) -> tuple[int, int]:
    """Array bytes of training messages (or replies) and of evaluate ones."""
    training = evaluation = 0
    for message in messages:
        size = record_dict_nbytes(message.content)
        if message.metadata.message_type == MessageType.EVALUATE:
            evaluation += size
        else:
            training += size
    return training, evaluation


def _record_evaluation(record: dict[str, Any], evaluation: PhaseOutcome) -> None:
    """Put an evaluation's per-client metrics, rejections, missing clients and means in
    ``record`` (replacing any earlier attempt's)."""
    for key in [k for k in record if k.startswith("test-")]:
        del record[key]
    report = evaluation.report
    record["evaluate"] = {str(c): m for c, m in report.accepted.items()}
    record["evaluate-rejected"] = dict(report.rejected)
    record["evaluate-missing"] = report.missing
    record.update(_means(evaluation.metrics, "test-", ("-mean", "-std")))


def _record_bytes(record: dict[str, Any], eval_down: int, eval_up: int) -> None:
    """A round's bytes both ways: its training phase's plus its evaluation's plus its exchange's
    own (``bytes-down-<exchange>``: under SecAgg+, the protocol's keys, shares and masked
    vectors)."""
    for way, evaluation in (("down", eval_down), ("up", eval_up)):
        prefix, train = f"bytes-{way}-", f"bytes-{way}-train"
        own = sum(v for k, v in record.items() if k.startswith(prefix) and k != train)
        record[f"bytes-{way}"] = record[train] + evaluation + own


def summarize(run: RunDirectory, config: ExperimentConfig, seconds: float) -> dict[str, Any]:
    """Final and best mean of the task's primary metric, totals of bytes and time over all rounds.

    Keys name the metric: ``final-test-<metric>-mean``, ``final-per-client-<metric>``, ...
    """
    primary = task_of(config).primary_metric
    key = f"{P.test_metric(primary)}-mean"
    rounds = run.rounds()
    evaluated = [r for r in rounds if key in r]
    final = evaluated[-1] if evaluated else {}
    best = max(evaluated, key=lambda r: r[key], default={})
    return {
        "run-name": run.name,
        "method": config.method,
        "dataset": config.dataset,
        "seed": config.seed,
        "rounds": len(rounds),
        "primary-metric": primary,
        "evaluation-split": config.evaluation_split,  # val: every test-* value is validation's
        f"final-test-{primary}-mean": final.get(key, math.nan),
        f"final-test-{primary}-std": final.get(f"{P.test_metric(primary)}-std", math.nan),
        f"final-per-client-{primary}": {  # keyed by the stable client id, not the node id
            str(int(m[P.CLIENT_ID])): m[P.test_metric(primary)]
            for m in final.get("evaluate", {}).values()
        },
        f"best-test-{primary}-mean": best.get(key, math.nan),
        "best-round": best.get("round"),
        "total-bytes-down": sum(r["bytes-down"] for r in rounds),
        "total-bytes-up": sum(r["bytes-up"] for r in rounds),
        "total-round-seconds": sum(r["round-seconds"] for r in rounds),
        "wall-seconds-this-session": seconds,
        **privacy_spent(config, rounds),
    }


def _means(
    metrics: MetricRecord | None, prefix: str, suffixes: tuple[str, ...]
) -> dict[str, float]:
    """The aggregated ``prefix...suffix`` metrics (e.g. ``test-rouge-l-mean``), as floats."""
    if metrics is None:
        return {}
    return {
        k: float(v)
        for k, v in metrics.items()
        if k.startswith(prefix) and k.endswith(suffixes) and k != f"{P.TRAIN_SECONDS}-mean"
    }
