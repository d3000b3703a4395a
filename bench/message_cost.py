"""What one warm message costs in the ClientApp, split into phases, against the bare compute.

    python -m bench.message_cost [--clients 10] [--repeats 5] [--out results.json] [--set k=v]
    python -m bench.message_cost --against HEAD --alternations 3 --out before-after.json

A simulation actor keeps its process (imports, data, the cached model) from one message to the
next, so a steady round pays only what the ClientApp does per message. This measures that in
one process: a short FedAvg run (``--method``: another method of the image task) on the
offline default (``server_apps.inprocess``, real strategy, real ClientApp) records the last
round's (fused) training messages, which are then
delivered again ``--repeats`` times to the real handlers. As Ray does, each delivery gets a
pickled copy of the message and of the node's context (copying is not timed), so no cache can
key on object identity.

Each delivery's wall time (``ClientApp.__call__``) is split into exclusive phases by timing the
functions that do the work (``PHASES``); ``other`` is what is left: Flower's dispatch, building
the reply's records and metrics, and the handler's own code. ``compute`` (the training steps and
the evaluation forward passes) is the work a bare PyTorch loop does too (``bench.bare_loop``);
``overhead`` is the total minus it. Prints a table of per-message medians (ms) and writes every
timing to ``--out`` as JSON. ``--profile N`` also prints cProfile's N heaviest functions of the
replayed deliveries.

``--against REF`` measures before and after in one invocation: it exports commit ``REF``
(``git archive``) with this script copied in, and runs the measurement in a fresh process in
that tree and in this checkout, alternately (``--alternations`` times each, so both sides see
the same machine load); the table then has both sides' medians over all their deliveries.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pickle
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent

# (phase, module, attribute path, absorbs): the functions timed, each counted to its phase
# exclusive of nested timed calls, except inside an absorbing one, which keeps its nested time.
PHASES: tuple[tuple[str, str, str, bool], ...] = (
    ("decode received", "client_apps.app", "_received", True),
    ("config parsing", "fedfm_flower.config.experiment", "ExperimentConfig.from_run_config", True),
    ("runtime set-up", "client_apps.base", "ClientRuntime.from_context", False),
    ("runtime set-up", "fedfm_flower.methods.halves", "client_class", True),
    ("runtime set-up", "client_apps.faults", "parse_faults", True),
    ("task and data lookup", "client_apps.base", "task_of", True),
    (
        "task and data lookup",
        "fedfm_flower.tasks.classification",
        "ImageClassification.client_data",
        True,
    ),
    ("model reset", "client_apps.base", "ClientRuntime.model", False),
    ("model reset", "fedfm_flower.models.build", "ModelCache.get", True),
    ("load received", "fedfm_flower.models.groups", "TunedModel.load_tensors", True),
    ("parameter selection", "client_apps.split", "SplitClient.split", True),
    ("parameter selection", "fedfm_flower.models.groups", "TunedModel.parameters_named", True),
    ("state load/save", "fedfm_flower.records.client_state", "ClientStateStore.load", True),
    ("state load/save", "fedfm_flower.records.client_state", "ClientStateStore.save", True),
    ("compute: train", "fedfm_flower.tasks.training", "train", True),
    ("compute: evaluate", "fedfm_flower.tasks.training", "evaluate", True),
    ("reply encoding", "fedfm_flower.models.groups", "TunedModel.tensors_named", True),
    ("reply encoding", "fedfm_flower.records.messages", "to_message_record", True),
)
COMPUTE = ("compute: train", "compute: evaluate")
ORDER = tuple(dict.fromkeys(p for p, *_ in PHASES)) + ("other",)


class PhaseClock:
    """Exclusive wall time per phase of the calls made while it is installed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list[Any]] = []  # [phase, started, nested seconds, absorbs]
        self.missing: list[str] = []  # functions of PHASES this tree does not have

    def timed(self, phase: str, function: Callable, absorbs: bool) -> Callable:
        """``function`` wrapped so that its exclusive time counts to ``phase``."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._stack and self._stack[-1][3]:
                return function(*args, **kwargs)  # inside an absorbing phase: its time
            frame = [phase, time.perf_counter(), 0.0, absorbs]
            self._stack.append(frame)
            try:
                return function(*args, **kwargs)
            finally:
                self._stack.pop()
                elapsed = time.perf_counter() - frame[1]
                self.seconds[phase] += elapsed - frame[2]
                if self._stack:
                    self._stack[-1][2] += elapsed

        return wrapper

    @contextmanager
    def installed(self) -> Iterator[PhaseClock]:
        """Patch every function of ``PHASES`` for the duration; restore them after."""
        undo = []
        for phase, module_name, path, absorbs in PHASES:
            owner: Any = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            raw = (
                owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            )
            if raw is None:  # a tree without this function (``--against`` an older commit)
                self.missing.append(f"{module_name}:{path}")
                continue
            if isinstance(raw, classmethod):
                patched: Any = classmethod(self.timed(phase, raw.__func__, absorbs))
            else:
                patched = self.timed(phase, raw, absorbs)
            setattr(owner, name, patched)
            undo.append((owner, name, raw))
        try:
            yield self
        finally:
            for owner, name, raw in reversed(undo):
                setattr(owner, name, raw)

    def take(self) -> dict[str, float]:
        """The seconds per phase since the last ``take``, and reset."""
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken


def record_messages(config: dict[str, Any], num_clients: int) -> tuple[list, dict]:
    """Run the experiment in process; its last round's training messages and every node's
    context."""
    from server_apps.inprocess import run_in_process

    _, grid = run_in_process(config, num_nodes=num_clients)
    last = str(config["num-server-rounds"])
    messages = [
        m
        for m in grid.sent
        if m.metadata.message_type == "train"
        and m.metadata.group_id == last
        and m.metadata.dst_node_id in grid.contexts
    ]
    return messages, grid.contexts


def replay(
    app: Any,
    messages: list,
    contexts: dict,
    repeats: int,
    profiler: cProfile.Profile | None,
    clock: PhaseClock | None = None,
) -> list[dict[str, Any]]:
    """Deliver ``messages`` ``repeats`` times each (pickled copies, as Ray sends them)."""
    clock = clock or PhaseClock()
    rows = []
    with clock.installed():
        for repeat in range(repeats):
            for message in messages:
                node = message.metadata.dst_node_id
                message_copy = pickle.loads(pickle.dumps(message))
                context_copy = pickle.loads(pickle.dumps(contexts[node]))
                clock.take()
                if profiler is not None:
                    profiler.enable()
                started = time.perf_counter()
                reply = app(message_copy, context_copy)
                total = time.perf_counter() - started
                if profiler is not None:
                    profiler.disable()
                phases = clock.take()
                if reply.has_error() or "train-error" in reply.content.config_records.get(
                    "config", {}
                ):
                    raise RuntimeError(f"the replayed message failed: {reply}")
                contexts[node] = context_copy  # the actor hands the updated context back
                phases["other"] = total - sum(phases.values())
                rows.append({"repeat": repeat, "node": node, "total": total, "phases": phases})
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-message statistics (seconds) of every phase, the total, the compute, the overhead
    (total - compute) and total / compute: the median, and the lower decile, which is what a
    message costs when nothing else on a shared machine gets in its way."""
    compute = [sum(r["phases"].get(p, 0.0) for p in COMPUTE) for r in rows]
    series = {p: [r["phases"].get(p, 0.0) for r in rows] for p in ORDER}
    series["total"] = [r["total"] for r in rows]
    series["compute"] = compute
    series["overhead"] = [r["total"] - c for r, c in zip(rows, compute, strict=True)]
    series["total/compute"] = [r["total"] / c for r, c in zip(rows, compute, strict=True)]
    return {
        "messages": len(rows),
        "median": {k: statistics.median(v) for k, v in series.items()},
        "p10": {k: _lower_decile(v) for k, v in series.items()},
    }


def _lower_decile(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[0] if len(values) > 1 else values[0]


SUMMARY_ROWS = (*ORDER, "total", "compute", "overhead", "total/compute")
SUMMARY_LABELS = {
    "total": "**total**",
    "compute": "compute (train + evaluate)",
    "overhead": "overhead (total - compute)",
}


def _cell(key: str, seconds: float) -> str:
    return f"{seconds:.3f}" if key == "total/compute" else f"{seconds * 1e3:.2f}"


def table(summary: dict[str, Any]) -> str:
    """A markdown table of the summary (ms per message: median and lower decile)."""
    lines = ["| phase | median ms | lower decile ms |", "|---|---:|---:|"]
    for key in SUMMARY_ROWS:
        lines.append(
            f"| {SUMMARY_LABELS.get(key, key)} | {_cell(key, summary['median'][key])} "
            f"| {_cell(key, summary['p10'][key])} |"
        )
    return "\n".join(lines)


def commit(tree: Path) -> str:
    """The short commit of the checkout ``tree``, with ``+dirty`` when it has changes
    ("exported" for a tree that is not a checkout)."""
    if not (tree / ".git").exists():
        return "exported"
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=tree,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return head + ("+dirty" if dirty else "")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Record the messages, replay them warm, and return the result (summary and rows)."""
    from fedfm_flower.config.overrides import parse_overrides

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="message-cost-") as workdir:
        config = {
            "seed": 0,
            "output-dir": workdir,
            **parse_overrides(args.set),
            "method": args.method,
            "num-clients": args.clients,
            "num-server-rounds": args.rounds,
        }
        messages, contexts = record_messages(config, args.clients)
        from client_apps.app import app

        replay(app, messages, contexts, 1, None)  # warm: every client's data and the model
        profiler = cProfile.Profile() if args.profile else None
        clock = PhaseClock()
        rows = replay(app, messages, contexts, args.repeats, profiler, clock)
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
        print(text.getvalue())
    import fedfm_flower

    return {
        "commit": commit(ROOT),
        "tree": str(Path(fedfm_flower.__file__).resolve().parent.parent),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": args.threads,
        "clients": args.clients,
        "repeats": args.repeats,
        "load-average": [load_before[0], os.getloadavg()[0]],
        "not-timed": clock.missing,
        "config": config | {"output-dir": None},
        "summary": summarize(rows),
        "rows": rows,
    }


def compare(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Run ``measure`` in a fresh process on commit ``args.against`` and on this checkout,
    alternately; both sides' runs and their pooled summaries."""
    forwarded = _without_option(argv, "--against", "--alternations", "--out")
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="message-cost-base-") as base:
        archive = subprocess.run(
            ["git", "archive", args.against], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
        shutil.copy(Path(__file__), Path(base) / "bench" / "message_cost.py")
        for alternation in range(args.alternations):
            for side, tree in (("before", Path(base)), ("after", ROOT)):
                out = Path(base) / f"{side}-{alternation}.json"
                command = [sys.executable, "-m", "bench.message_cost", *forwarded, "--out", out]
                print(f"[{side} {alternation + 1}/{args.alternations}] {tree}", flush=True)
                subprocess.run(command, cwd=tree, check=True, stdout=subprocess.DEVNULL)
                result = json.loads(out.read_text())
                if Path(result["tree"]) != tree.resolve():
                    raise RuntimeError(f"{side} imported fedfm_flower from {result['tree']}")
                runs[side].append(result)
    pooled = {
        side: summarize([row for run in results for row in run["rows"]])
        for side, results in runs.items()
    }
    against = subprocess.run(
        ["git", "rev-parse", "--short", args.against], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "against": args.against,
        "before-commit": against,
        "after-commit": runs["after"][0]["commit"],
        "summary": pooled,
        "runs": {side: [r | {"rows": None} for r in results] for side, results in runs.items()},
        "rows": {
            side: [row for r in results for row in r["rows"]] for side, results in runs.items()
        },
    }


def comparison_table(before: dict[str, Any], after: dict[str, Any]) -> str:
    """A markdown table of both sides' per-message medians and lower deciles (ms)."""
    lines = [
        "| phase | before median ms | after median ms | before lower decile | after lower decile |",
        "|---|---:|---:|---:|---:|",
    ]
    for key in SUMMARY_ROWS:
        cells = [
            _cell(key, side[stat][key]) for stat in ("median", "p10") for side in (before, after)
        ]
        lines.append(f"| {SUMMARY_LABELS.get(key, key)} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _without_option(argv: list[str], *names: str) -> list[str]:
    """``argv`` without the options ``names`` and their values."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in names:
            skip = True
            continue
        if item.split("=", 1)[0] in names:
            continue
        kept.append(item)
    return kept


def main(argv: list[str] | None = None) -> int:
    """Measure (or compare with ``--against``), print the table, write the JSON."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="fedavg", help="a method of the image task")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="recorded run's rounds (>= 2)")
    parser.add_argument("--repeats", type=int, default=5, help="deliveries of each message")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--against", default="", metavar="REF", help="compare with a commit")
    parser.add_argument("--alternations", type=int, default=3, help="runs per side (--against)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.against:
        result = compare(args, argv)
        print(comparison_table(result["summary"]["before"], result["summary"]["after"]))
    else:
        result = measure(args)
        print(table(result["summary"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
