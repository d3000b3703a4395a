"""A sweep: methods x setups x seeds, run in process, resumable; it feeds ``fedfm_flower.report``.

    python -m fedfm_flower.sweep --methods local fedavg fedrep pfedseq pfedpg:basis-only \\
        --setups glyphs-feature-skew glyphs-label-skew --seeds 0 1 2 --out runs/glyphs
    python -m fedfm_flower.report runs/glyphs --out reports/glyphs
    python -m fedfm_flower.sweep --table pfedseq-t1 --stand-in --out runs/pfedseq-t1

``--table NAME`` runs a paper's table (``configs/tables/<name>.toml``,
``fedfm_flower.study.paper_tables``): each cell's method on its column's setting (the paper's,
or with ``--stand-in`` the offline setup standing in for it), and leaves ``table.json`` for the
report's paper-ordered table.

A cell's run config is layered, later layers winning: ``configs/setups/<setup>.toml`` (the
data, model and training of the setup), ``configs/<method>/<setup>.toml`` (the method's own
keys for that setup; either file may be missing, not both), ``configs/<method>/<variant>.toml``
for ``method:variant`` (the papers' ablations), the ``--set`` overrides, and finally the
cell's identity: ``method``, ``seed``, ``label`` (``method:variant``), ``setup``, the output
directory and the run name ``<method>-<variant>-<setup><tag>-s<seed>``.

Each run is the real ServerApp loop and ClientApp in one process (``server_apps.inprocess``),
with client state on disk under ``<out>/client-state`` so that an interrupted run resumes
exactly. Runs go one after another in this process, or with ``--ray`` / ``--ray-address`` as
parallel Ray tasks (``fedfm_flower.study.pools``), on this machine or a Ray cluster. Rerunning the
same command skips finished runs (their ``summary.json`` exists), resumes interrupted ones from
their newest checkpoint, and starts the rest. Every cell's config
is validated before the first run (a bad one: exit status 2, nothing run); a run that fails is
reported, the others still run, and the exit status is 1. ``<out>/sweep.json`` lists every cell
run into ``<out>`` (this sweep's and earlier ones') with its state, time and error, as each
finishes. The runs of one setup and data seed must share one foundation model
(``fedfm_flower.study.grid_foundations``): a directory whose finished runs do not is refused (exit
status 2, nothing run), and a run that ends on another model stops the sweep (exit status 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfm_flower.config.experiment import ConfigError, ExperimentConfig
from fedfm_flower.config.files import CONFIG_ROOT
from fedfm_flower.config.overrides import parse_overrides
from fedfm_flower.records.durable import atomic_write_text, exclusive_lock
from fedfm_flower.records.logs import configure_logging
from fedfm_flower.study.cells import Cell, runs_of
from fedfm_flower.study.grid_foundations import FoundationMismatch, SetupFoundations
from fedfm_flower.study.paper_tables import load_table, record_table, table_plan
from fedfm_flower.study.pools import SerialPool, make_pool

if TYPE_CHECKING:
    from fedfm_flower.study.pools import CellPool

INTERRUPTED = (
    "interrupted: rerun the same command to resume (finished runs are kept, interrupted ones "
    "resume from their newest checkpoint)"
)


def _run_stem(label: str, setup: str, tag: str) -> str:
    return f"{label.replace(':', '-')}-{setup}{tag}-s"


def run_name(label: str, setup: str, tag: str, seed: int) -> str:
    """The run directory name of one (method label, setup, tag, seed) cell."""
    return f"{_run_stem(label, setup, tag)}{seed}"


def seed_of_run(name: str, label: str, setup: str, tag: str) -> int | None:
    """The seed of the run directory ``name`` when it is a (label, setup, tag) cell's
    (``run_name``'s inverse), else None."""
    seed = name.removeprefix(_run_stem(label, setup, tag))
    return int(seed) if seed != name and seed.isdigit() else None


def _read_toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def variant_settings(label: str, configs: Path = CONFIG_ROOT) -> dict[str, Any]:
    """What ``configs/<method>/<variant>.toml`` sets for a ``method:variant`` label ({} for a
    method); ``FileNotFoundError`` names a missing variant file."""
    method, _, variant = label.partition(":")
    if not variant:
        return {}
    variant_file = configs / method / f"{variant}.toml"
    if not variant_file.is_file():
        raise FileNotFoundError(f"variant '{label}': {variant_file} does not exist")
    return _read_toml(variant_file)


def cell_config(
    label: str,
    setup: str,
    seed: int,
    out: Path,
    overrides: dict[str, Any] | None = None,
    tag: str = "",
    configs: Path = CONFIG_ROOT,
) -> dict[str, Any]:
    """The run config of one cell (the layers of the module docstring)."""
    method = label.partition(":")[0]
    setup_file = configs / "setups" / f"{setup}.toml"
    method_file = configs / method / f"{setup}.toml"
    if not setup_file.is_file() and not method_file.is_file():
        raise FileNotFoundError(f"setup '{setup}': neither {setup_file} nor {method_file} exists")
    config = {
        **_read_toml(setup_file),
        **_read_toml(method_file),
        **variant_settings(label, configs),
    }
    config.update(overrides or {})
    config.update(
        {
            "method": method,
            "seed": seed,
            "label": label,
            "setup": setup + tag,
            "output-dir": str(runs_of(out)),
            "run-name": run_name(label, setup, tag, seed),
            "client-state-dir": str(out / "client-state"),
        }
    )
    return config


def build_cells(
    labels: list[str],
    setups: list[str],
    seeds: list[int],
    out: Path,
    overrides: dict[str, Any] | None = None,
    tag: str = "",
    configs: Path = CONFIG_ROOT,
    only: Collection[tuple[str, str]] | None = None,
) -> list[Cell]:
    """Every cell of the grid, setups outermost, validated (``ValueError`` names the bad one);
    ``only``: just these (setup, label) pairs (a paper table whose rows name a method per
    column)."""
    cells = [
        Cell(
            label, setup + tag, seed, cell_config(label, setup, seed, out, overrides, tag, configs)
        )
        for setup in setups
        for label in labels
        if only is None or (setup, label) in only
        for seed in seeds
    ]
    check_configs([cell.config for cell in cells])
    return cells


def check_configs(configs: list[dict[str, Any]]) -> None:
    """Validate every run config; the ``ValueError`` names the run and the bad value."""

    defaults = ExperimentConfig().to_run_config()
    for config in configs:
        if int(config.get("num-clients", 0)) < 1:  # in process, no node config gives the count
            raise ValueError(
                f"run {config['run-name']}: num-clients = {config.get('num-clients', 0)}; a "
                "sweep runs in process and needs num-clients >= 1 (--set num-clients=N)"
            )
        try:
            ExperimentConfig.from_run_config({**defaults, **config})
        except ConfigError as err:
            raise ValueError(f"run {config['run-name']}: {err}") from err


def _earlier_records(out: Path) -> dict[str, dict[str, Any]]:
    """Records of earlier sweeps into ``out`` (by run directory); none if unreadable."""
    try:
        return {r["run"]: r for r in json.loads((out / "sweep.json").read_text())["cells"]}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def duration(seconds: float) -> str:
    """``seconds`` for a progress line: '40 s', '12 min', '2 h 05 min'."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


@dataclass
class TimeLeft:
    """A command's elapsed time and its time left. The cells left of each kind (a method's
    runs) take that kind's mean seconds per whole cell so far (the mean over every kind until a
    cell of it has run); their sum is divided by the cells' seconds per wall second so far (how
    many ran at once). Cells found finished (on resume) end at once and add no seconds; a
    resumed cell's seconds are a part of a cell's, so they count as work done but not in a
    kind's mean. ``earlier``: seconds per cell of each kind that earlier commands ran (a
    resumed study's ended trials), taken for a kind until a cell of it runs here."""

    cells: int  # the cells the command has to end
    kinds: Mapping[str, int] = field(default_factory=dict)  # of those, how many of each kind
    clock: Callable[[], float] = time.monotonic
    earlier: Mapping[str, list[float]] = field(default_factory=dict)
    ended_cells: Counter[str] = field(default_factory=Counter, init=False)
    seconds: dict[str, list[float]] = field(default_factory=dict, init=False)  # whole cells'
    worked: float = field(default=0.0, init=False)  # every cell's seconds this command
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock()

    def ended(self, kind: str = "", seconds: float | None = None, before: str = "new") -> str:
        """Count one more ended cell of ``kind`` that ran ``seconds`` (None: not known) from
        its state ``before`` (``cells.cell_state``: 'new', 'interrupted' or 'done'); what a
        progress line says of the time."""
        self.ended_cells[kind] += 1
        if seconds is not None and before != "done":
            self.worked += seconds
            if before == "new":
                self.seconds.setdefault(kind, []).append(seconds)
        elapsed = self.clock() - self.started
        per_kind = {**self.earlier, **self.seconds}
        whole = [s for of_kind in per_kind.values() for s in of_kind]
        left = self.cells - sum(self.ended_cells.values())
        if not whole or self.worked <= 0 or left <= 0:
            return f"{duration(elapsed)} elapsed"
        mean = sum(whole) / len(whole)
        work_left = 0.0
        for name, count in self.kinds.items():
            of_kind = max(0, count - self.ended_cells[name])
            known = per_kind.get(name)
            work_left += of_kind * (sum(known) / len(known) if known else mean)
            left -= of_kind
        work_left += max(0, left) * mean  # cells of no declared kind
        return (
            f"{duration(elapsed)} elapsed, about {duration(elapsed * work_left / self.worked)} left"
        )


class SweepLog:
    """``<out>/sweep.json``, rewritten as each cell finishes (with the records other sweeps
    into ``out`` wrote, earlier or at the same time), and a progress line per cell that ends
    with the time elapsed and left."""

    def __init__(self, out: Path, total: int, time_left: TimeLeft | None = None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.total = out, total
        self.time_left = time_left or TimeLeft(total)
        self.done = 0
        self._mine: dict[str, dict[str, Any]] = {}  # this sweep's records, by run directory

    def add(self, cell: Cell, record: dict[str, Any]) -> None:
        """Record a finished cell and say how it ended."""
        self.done += 1
        time_said = self.time_left.ended(
            cell.kind, record.get("seconds"), record.get("state-before", "new")
        )
        if record["state"] == "failed":
            print(
                f"FAILED {cell.label} {cell.setup} seed {cell.seed}: {record['error']} "
                f"[{self.done}/{self.total}; {time_said}]",
                file=sys.stderr,
            )
        else:
            print(
                f"[{self.done}/{self.total}] {cell.label} {cell.setup} seed {cell.seed}: "
                f"{record['metric']} {record['final']:.4f} ({record['state-before']}); "
                f"{time_said}",
                flush=True,
            )
        self._mine[record["run"]] = record
        with exclusive_lock(self.out / ".sweep.json.lock"):  # one sweep at a time reads + writes
            everything = {**_earlier_records(self.out), **self._mine}
            cells_json = json.dumps({"cells": list(everything.values())}, indent=2)
            atomic_write_text(self.out / "sweep.json", cells_json)


def run_sweep(
    cells: list[Cell],
    out: Path,
    pool: CellPool | None = None,
    foundations: SetupFoundations | None = None,
) -> list[dict[str, Any]]:
    """Run every cell in ``pool`` (default: one after another here), recording each as it
    finishes in ``<out>/sweep.json`` (kept with the records of earlier sweeps into ``out``)
    after ``foundations`` has checked its model (``FoundationMismatch`` stops the sweep);
    returns this sweep's records in the cells' order."""

    pool = pool or SerialPool()
    log = SweepLog(out, len(cells), TimeLeft(len(cells), Counter(c.kind for c in cells)))
    for cell in cells:
        pool.submit(cell)
    done: dict[Path, dict[str, Any]] = {}
    while pool.pending():
        cell, record = pool.next_done()
        if foundations is not None:
            foundations.add(cell.run_dir)
        done[cell.run_dir] = record
        log.add(cell, record)
    return [done[cell.run_dir] for cell in cells]


def add_grid_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """The command-line options of which cells to build and where they run (the sweep's and
    the tuning command's); ``required`` False when another option can name the cells."""
    parser.add_argument("--methods", nargs="+", required=required, help="method or method:variant")
    parser.add_argument("--setups", nargs="+", required=required, help="configs/setups/<name>.toml")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--tag", default="", help="suffix of the setup names of --set runs")
    parser.add_argument("--configs", type=Path, default=CONFIG_ROOT, help=argparse.SUPPRESS)
    group = parser.add_argument_group("parallel cells on Ray")
    group.add_argument("--ray", action="store_true", help="run cells as Ray tasks on this machine")
    group.add_argument(
        "--ray-address", default="", help="join this Ray cluster: auto, host:port or ray://..."
    )
    group.add_argument("--cpus-per-cell", type=float, default=1.0, help="Ray num_cpus of a cell")
    group.add_argument("--gpus-per-cell", type=float, default=0.0, help="Ray num_gpus of a cell")


def pool_from_arguments(args: argparse.Namespace) -> CellPool:
    """The pool the options ask for (``ValueError`` names a bad resource value)."""

    return make_pool(args.ray, args.ray_address, args.cpus_per_cell, args.gpus_per_cell)


def run_grid(pool: CellPool, work: Callable[[], None]) -> int | None:
    """Do ``work`` (a grid's cells in ``pool``), then close the pool; None when it ended, else
    the command's exit status, its reason said: 1 at a run on another foundation model than
    its setup's others, 130 at Ctrl-C. A SIGTERM's ``SystemExit`` goes on, after saying how
    to resume."""
    try:
        work()
    except FoundationMismatch as err:  # the grid cannot go on
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    except SystemExit:  # SIGTERM (processes.exit_on_sigterm): its exit status, said
        print(INTERRUPTED, file=sys.stderr)
        raise
    finally:
        pool.close()
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; exit status 0 (all done), 1 (a run failed), 2 (bad arguments), 130
    (interrupted with Ctrl-C), or SIGTERM's 143 (1 when it lands inside Ray's wait)."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.sweep", description=__doc__.split("\n")[0]
    )
    add_grid_arguments(parser, required=False)
    parser.add_argument(
        "--table",
        default="",
        help="a paper's table by name (configs/tables/<name>.toml): its rows x columns, in "
        "place of --methods and --setups",
    )
    parser.add_argument(
        "--stand-in",
        action="store_true",
        help="with --table: the offline stand-in setups in place of the paper's settings",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, required=True, help="sweep directory")
    args = parser.parse_args(argv)

    configure_logging()
    table = None
    try:
        if args.table:
            if args.methods or args.setups:
                raise ValueError("--table names the methods and setups: drop --methods/--setups")
            table = load_table(args.table, args.configs)
            args.methods, args.setups = table.labels(), table.setups(args.stand_in)
            print(table_plan(table, args.stand_in))
        elif not (args.methods and args.setups) or args.stand_in:
            raise ValueError("give --methods and --setups, or --table [--stand-in]")
        overrides = parse_overrides(args.set)
        cells = build_cells(
            args.methods,
            args.setups,
            args.seeds,
            args.out,
            overrides,
            args.tag,
            args.configs,
            only=None if table is None else set(table.runs(args.stand_in)),
        )
        foundations = SetupFoundations.of_finished_runs([runs_of(args.out)])
        if table is not None:
            record_table(args.out, table, args.stand_in)
        pool = pool_from_arguments(args)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    records: list[dict[str, Any]] = []
    stopped = run_grid(pool, lambda: records.extend(run_sweep(cells, args.out, pool, foundations)))
    if stopped is not None:
        return stopped
    failed = [r for r in records if r["state"] == "failed"]
    if failed:
        print(
            f"error: {len(failed)} of {len(records)} runs failed (see sweep.json)", file=sys.stderr
        )
        return 1
    print(
        f"sweep done: {len(records)} runs in {args.out}; report: "
        f"python -m fedfm_flower.report {args.out} --out <dir>"
    )
    return 0
