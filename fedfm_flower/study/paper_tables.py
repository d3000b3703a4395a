"""The papers' tables by name: which method, variant and setup reproduce each row.

A table is declared once, in ``configs/tables/<name>.toml`` (``pfedseq-t1`` is pFedSeq's
Table 1): the paper and table it reproduces, its columns, each with the **paper's setting**
(``setup``: ``configs/setups/<setup>.toml`` plus ``configs/<method>/<setup>.toml`` where a
method sets keys of its own, as in any sweep) and an **offline stand-in** (``stand-in``: a
setup that runs on a CPU with nothing downloaded; a column without one is left out of
``--stand-in`` runs), and its rows in the paper's order, each a
method label (``method`` or ``method:variant``) or a ``missing`` reason for a row the
framework cannot run. A row may carry the paper's reported figures (``paper``, one per column,
blank where the paper has none) so that the report sets ours beside them.

A row whose method differs by column names one per column instead (``methods``, ``""`` for a
cell the framework cannot run, with the row's ``missing`` saying why): FedPerfix's Table 3 runs
FedBN on the ViT-Small column keeping layer norms and on the ResNet50 column keeping batch
norms, and FedPerfix on the ViT column only (the paper's "-"). A sweep of the table runs each
cell's method on its column's setup only; a method label appears at most once per column (and
block).

A cell is the report's main metric of (column setup, row method), unless the table's columns
are **client tasks** of one federation (FedDPA's Table 1, ``feddpa-t1``): then every column
names its ``task``, as the report's per-task table (``fedfm_flower.report.task_table``) names
its columns: a client task's name, or ``Average``. The task table of an instruction run names
a client by its task (the offline ``instructions`` data's task, ``client_task``; a ``flan``
client's most common record category), so a column's task differs between the paper's data
and the offline stand-in's; ``stand-in-task`` names the stand-in's (default: ``task``). Every
row then names its ``block``, the task table's block its cells come from (``Personalization``
or ``Test-time personalization``, ``task_table.BLOCKS``). The block is a row's, not the
table's, because the paper's two blocks are one table of the same runs (every test-time row's
method is also a personalization row): one sweep and one report give both, where two tables
would need two run folders (a folder records one table) of the same runs. A method label may
then appear once per block. Columns are matched to tasks by name, not by client order: the
task table orders its columns by client, the paper by its own choice. The block may instead be
the **columns'**: where every task column names its ``block``, no row does, and a row's cells
come from each column's block (FedDPA's ablation tables, ``feddpa-t3``: a column per dataset
and block, its task ``Average``; their columns may name different setups). The blocks are all
on the columns or all on the rows: a table where some task columns name a block and others do
not is refused naming the columns without one, and a row's block beside the columns' is refused
naming the row.

A column's block may also be an **unseen** one, ``Unseen tasks (AVG)`` or ``Unseen tasks (MAX)``
(``task_table.UNSEEN_BLOCKS``; FedDPA's Table 14, ``feddpa-t14``): its ``task`` is then a
test-time task outside the federation (run config ``unseen-test-dir``: a test file's most common
category; ``unseen-tasks`` offline), and its cell the mean over seeds of each seed's mean (AVG) or
highest (MAX) over the clients of the client's ROUGE-1 on that task, as the task table's unseen
blocks. Only columns name an unseen block (a row naming one is refused), and an unseen column
names a task, not ``Average`` (refused).

Likewise a table whose columns are **modality-task pairs** of the multi-task federation (TAP's
Table 1, ``tap-t1``): every column names its ``pair``, a row of the report's per-pair table
(``fedfm_flower.report.pair_table``) by that table's row name, ``<metric> <pair>`` (``metric``
one of ``pair_table.PAIR_METRICS``, ``pair`` one of ``data.multitask.MULTITASK_TASKS``: ``mse
image-gen``), and a cell is that table's cell of (pair, row method): the mean over seeds of each
seed's mean over the clients holding the pair, ± its 95% half-width. ``stand-in-pair`` names
the stand-in's (default: ``pair``). A pair column's rows name no block.

Likewise a table whose columns are the **client domains** of one federation per dataset
(pFedPG's Table 1, ``pfedpg-t1``: one client per domain): every column names its ``domain``,
as the runs record each client's (``config.json``'s ``client-domains``: an image folder's
domain folder, a copy's domain value, ``fedfm_flower.data.client_domains``; a run without it
names its clients ``client <id>``), or is ``Average``: the mean of the domain columns before it
since the previous ``Average``, each domain weighing the same (the paper's Avg. of a dataset's
domains), of the same setup and stand-in, each domain once. A cell is the mean over seeds of
each seed's mean over the domain's clients of the final metric (for an ``Average``, of each
seed's mean over its domains, seeds with all of them), ± its 95% half-width, as the pair
table's (``fedfm_flower.report.domain_table``). ``stand-in-domain`` names the stand-in's
(default: ``domain``); an ``Average`` stays one. A domain column's rows name no block. A
table's columns are all tasks, all pairs, all domains or all setups.

    python -m fedfm_flower.sweep --table pfedseq-t1 --seeds 0 1 2 --out runs/pfedseq-t1
    python -m fedfm_flower.sweep --table pfedseq-t1 --stand-in --out runs/pfedseq-t1-offline
    python -m fedfm_flower.report runs/pfedseq-t1 --out reports/pfedseq-t1

The sweep writes the table it ran to ``<out>/table.json``; the report then adds the table in
the paper's row and column order with the paper's figures beside ours.

Imports inside functions keep ``numpy`` and ``scipy`` out of this module's start-up.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfm_flower.config.files import CONFIG_ROOT
from fedfm_flower.records.durable import atomic_write_text

TABLE_FILE = "table.json"
AVERAGE = "Average"  # a domain column averaging the domain columns before it


@dataclass(frozen=True)
class Column:
    """One column: the paper's setting and the offline setup standing in for it (None: the
    column has no offline stand-in); for a task-column table, the client task it shows on
    each (None: the column is a setup, its cells the main metric)."""

    name: str
    setup: str
    stand_in: str | None
    task: str | None = None
    stand_in_task: str | None = None
    pair: str | None = None  # the pair table's row, ``<metric> <pair>`` (pair-column tables)
    stand_in_pair: str | None = None
    domain: str | None = None  # a client group's domain, or ``Average`` (domain-column tables)
    stand_in_domain: str | None = None
    block: str | None = None  # the task table's block of its cells, where not the rows'

    def setup_of(self, stand_in: bool) -> str | None:
        """The setup this column runs on: the paper's, or its stand-in (None: none)."""
        return self.stand_in if stand_in else self.setup

    def task_of(self, stand_in: bool) -> str | None:
        """The client task this column shows on that setting (None: not a task column)."""
        return (self.stand_in_task or self.task) if stand_in else self.task

    def pair_of(self, stand_in: bool) -> str | None:
        """The pair-table row this column shows on that setting (None: not a pair column)."""
        return (self.stand_in_pair or self.pair) if stand_in else self.pair

    def domain_of(self, stand_in: bool) -> str | None:
        """The domain this column shows on that setting (None: not a domain column)."""
        return (self.stand_in_domain or self.domain) if stand_in else self.domain


@dataclass(frozen=True)
class Row:
    """One row: the method label that reproduces each of its cells (None: a cell the framework
    cannot run), and why where one is None."""

    name: str
    labels: tuple[str | None, ...]  # one per column
    missing: str
    paper: tuple[float | None, ...]
    block: str | None = None  # the task table's block of its cells (task-column tables only)

    @property
    def label(self) -> str | None:
        """The row's method where every column runs the same one, else None."""
        distinct = set(self.labels)
        return self.labels[0] if len(distinct) == 1 else None

    def ran(self) -> list[str]:
        """The labels its cells run, each once, in column order."""
        return list(dict.fromkeys(label for label in self.labels if label is not None))


@dataclass(frozen=True)
class PaperTable:
    """A declared table of a paper."""

    key: str
    paper: str
    table: str
    title: str
    reference: str
    metric: str
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]

    def labels(self) -> list[str]:
        """The method labels of the cells the framework runs, in the paper's order (each once,
        though a task-column table may list one in two blocks)."""
        return list(dict.fromkeys(label for row in self.rows for label in row.ran()))

    def runs(self, stand_in: bool = False) -> list[tuple[str, str]]:
        """The (setup, label) pairs its cells run on that setting, each once (columns without
        a stand-in left out)."""
        pairs = (
            (column.setup_of(stand_in), label)
            for row in self.rows
            for column, label in zip(self.columns, row.labels, strict=True)
            if label is not None
        )
        return list(dict.fromkeys((s, label) for s, label in pairs if s is not None))

    def setups(self, stand_in: bool = False) -> list[str]:
        """The columns' setups: the paper's, or the offline stand-ins (columns without one
        left out)."""
        setups = (c.setup_of(stand_in) for c in self.columns)
        return list(dict.fromkeys(s for s in setups if s is not None))

    def missing(self) -> list[Row]:
        """The rows with a cell the framework cannot run."""
        return [row for row in self.rows if None in row.labels]

    def missing_columns(self, row: Row) -> list[str]:
        """The names of the columns where ``row`` has no method (all of them: none of its)."""
        if all(label is None for label in row.labels):
            return []
        return [c.name for c, label in zip(self.columns, row.labels, strict=True) if label is None]

    def to_json(self, stand_in: bool) -> dict[str, Any]:
        """What a sweep records in ``table.json``: the table and the setting it ran."""
        return {
            "key": self.key,
            "paper": self.paper,
            "table": self.table,
            "title": self.title,
            "metric": self.metric,
            "reference": self.reference,
            "setting": "stand-in" if stand_in else "paper",
            "columns": [
                {
                    "name": c.name,
                    "setup": c.setup_of(stand_in),
                    "task": c.task_of(stand_in),
                    "pair": c.pair_of(stand_in),
                    "domain": c.domain_of(stand_in),
                    "domains": averaged,
                    "block": c.block,
                }
                for c, averaged in zip(
                    self.columns, averaged_domains(self.columns, stand_in), strict=True
                )
            ],
            "rows": [
                {
                    "name": r.name,
                    "label": r.label,
                    "labels": list(r.labels),
                    "missing": r.missing,
                    "missing-columns": self.missing_columns(r),
                    "paper": list(r.paper),
                    "block": r.block,
                }
                for r in self.rows
            ],
        }


def averaged_domains(columns: tuple[Column, ...], stand_in: bool) -> list[list[str] | None]:
    """Per column, the domains its cell averages over (None: not a domain column): its own
    domain, or for an ``Average`` column those of the domain columns since the previous
    ``Average`` (the paper's Avg. of a dataset's domain columns)."""
    out: list[list[str] | None] = []
    group: list[str] = []
    for column in columns:
        domain = column.domain_of(stand_in)
        if domain is None:
            out.append(None)
        elif domain == AVERAGE:
            out.append(group)
            group = []
        else:
            out.append([domain])
            group = [*group, domain]
    return out


def tables_dir(configs: Path = CONFIG_ROOT) -> Path:
    """Where the tables are declared."""
    return configs / "tables"


def table_names(configs: Path = CONFIG_ROOT) -> list[str]:
    """Every declared table's name, sorted."""
    return sorted(p.stem for p in tables_dir(configs).glob("*.toml"))


def _text(data: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or (default is None and not value):
        raise ValueError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
    return value


def _paper_values(value: Any, columns: int, where: str) -> tuple[float | None, ...]:
    if value is None:
        return (None,) * columns
    if not isinstance(value, list) or len(value) != columns:
        raise ValueError(f"{where}: 'paper' must list one figure per column ({columns})")
    out: list[float | None] = []
    for item in value:
        if item == "":
            out.append(None)
        elif isinstance(item, int | float) and not isinstance(item, bool) and math.isfinite(item):
            out.append(float(item))
        else:
            raise ValueError(f"{where}: 'paper' holds {item!r}; a number, or \"\" for none")
    return tuple(out)


def _pair(data: dict[str, Any], key: str, where: str) -> str | None:
    """A column's ``pair`` or ``stand-in-pair``: a pair-table row name, ``<metric> <pair>``."""
    from fedfm_flower.data.multitask import MULTITASK_TASKS
    from fedfm_flower.report.pair_table import PAIR_METRICS

    if key not in data:
        return None
    value = _text(data, key, where)
    metric, _, pair = value.partition(" ")
    if metric not in PAIR_METRICS or pair not in MULTITASK_TASKS:
        raise ValueError(
            f"{where}: '{key}' = {value!r} is no row of the pair table: '<metric> <pair>', "
            f"metric one of {', '.join(PAIR_METRICS)}, pair one of {', '.join(MULTITASK_TASKS)}"
        )
    return value


def _column(data: dict[str, Any], where: str) -> Column:
    stand_in = _text(data, "stand-in", where) if "stand-in" in data else None
    task = _text(data, "task", where) if "task" in data else None
    stand_in_task = _text(data, "stand-in-task", where) if "stand-in-task" in data else None
    if stand_in_task is not None and (task is None or stand_in is None):
        raise ValueError(f"{where}: 'stand-in-task' needs the column's 'task' and 'stand-in'")
    pair, stand_in_pair = _pair(data, "pair", where), _pair(data, "stand-in-pair", where)
    if stand_in_pair is not None and (pair is None or stand_in is None):
        raise ValueError(f"{where}: 'stand-in-pair' needs the column's 'pair' and 'stand-in'")
    if task is not None and pair is not None:
        raise ValueError(f"{where}: a column names a client 'task' or a 'pair', not both")
    domain = _domain(data, "domain", where)
    stand_in_domain = _domain(data, "stand-in-domain", where)
    if stand_in_domain is not None and (domain is None or stand_in is None):
        raise ValueError(f"{where}: 'stand-in-domain' needs the column's 'domain' and 'stand-in'")
    if stand_in_domain is not None and (stand_in_domain == AVERAGE) != (domain == AVERAGE):
        raise ValueError(
            f"{where}: 'domain' = {domain!r} and 'stand-in-domain' = {stand_in_domain!r}: an "
            f"{AVERAGE!r} column stays one on the stand-in, a domain stays a domain"
        )
    if domain is not None and (task is not None or pair is not None):
        raise ValueError(f"{where}: a column names a 'domain', a client 'task' or a 'pair'")
    block = _known_block(data, where, unseen=True) if "block" in data else None
    if block is not None and task is None:
        raise ValueError(f"{where}: 'block' = {block!r} needs the column's client 'task'")
    if block in _unseen_blocks() and AVERAGE in (task, stand_in_task):
        raise ValueError(
            f"{where}: block {block!r} has a column per unseen task and no {AVERAGE!r}; name "
            "the unseen task (its test file's category)"
        )
    return Column(
        _text(data, "name", where),
        _text(data, "setup", where),
        stand_in,
        task,
        stand_in_task,
        pair,
        stand_in_pair,
        domain=domain,
        stand_in_domain=stand_in_domain,
        block=block,
    )


def _domain(data: dict[str, Any], key: str, where: str) -> str | None:
    """A column's ``domain`` or ``stand-in-domain``: a client group's domain as the runs record
    it, or ``Average``."""
    return _text(data, key, where) if key in data else None


def _domain_groups(columns: tuple[Column, ...], path: Path) -> None:
    """An ``Average`` column averages the domain columns since the previous one: there must be
    some, of its setup and stand-in, and no domain twice."""
    group: list[Column] = []
    for column in columns:
        if column.domain != AVERAGE:
            group.append(column)
            continue
        where = f"{path} column {column.name!r}"
        if not group:
            raise ValueError(
                f"{where}: an {AVERAGE!r} column averages the domain columns before it (since "
                "the previous one), and there are none"
            )
        for other in group:
            if (other.setup, other.stand_in) != (column.setup, column.stand_in):
                raise ValueError(
                    f"{where}: averages column {other.name!r}, whose setup or stand-in differs "
                    f"({other.setup}, {other.stand_in} against {column.setup}, {column.stand_in})"
                )
        for stand_in in (False, True):
            domains = [c.domain_of(stand_in) for c in group]
            twice = sorted({d for d in domains if domains.count(d) > 1})
            if twice and (not stand_in or column.stand_in is not None):
                raise ValueError(
                    f"{where}: averages domain {', '.join(twice)} twice"
                    f"{' on the stand-in' if stand_in else ''}; name each domain once"
                )
        group = []


def _task_columns(columns: tuple[Column, ...], path: Path) -> bool:
    """Whether the columns are client tasks (every one names its task, or none does; the same
    for pairs and domains, whose ``Average`` columns must each have a group to average)."""
    for key in ("task", "pair", "domain"):
        named = [c.name for c in columns if getattr(c, key) is not None]
        if named and len(named) != len(columns):
            bare = ", ".join(c.name for c in columns if getattr(c, key) is None)
            raise ValueError(
                f"{path}: columns {bare} name no '{key}' while others do; a table's columns "
                "are all client tasks, all pairs, all domains or all setups"
            )
    if columns[0].domain is not None:
        _domain_groups(columns, path)
    return columns[0].task is not None


def _block_titles() -> list[str]:
    """The task table's blocks (``task_table.BLOCKS``)."""
    from fedfm_flower.report.task_table import BLOCKS

    return [title for title, _ in BLOCKS]


def _unseen_blocks() -> tuple[str, ...]:
    """The task table's blocks of unseen test-time tasks (``task_table.UNSEEN_BLOCKS``)."""
    from fedfm_flower.report.task_table import UNSEEN_BLOCKS

    return UNSEEN_BLOCKS


def _known_block(data: dict[str, Any], where: str, unseen: bool = False) -> str:
    """A row's or column's ``block``: one of the task table's (``unseen``: a column's, which
    may also be an unseen block; a row's may not)."""
    known = [*_block_titles(), *(_unseen_blocks() if unseen else ())]
    block = _text(data, "block", where)
    if block in _unseen_blocks() and not unseen:
        raise ValueError(
            f"{where}: 'block' = {block!r} is a column's, not a row's: its columns are unseen "
            "tasks, each naming its aggregate block"
        )
    if block not in known:
        raise ValueError(f"{where}: unknown 'block' {block!r}; known: {', '.join(known)}")
    return block


def _column_blocks(columns: tuple[Column, ...], path: Path) -> bool:
    """Whether the columns name the blocks (every one does, or none does)."""
    named = [c for c in columns if c.block is not None]
    if named and len(named) != len(columns):
        bare = ", ".join(c.name for c in columns if c.block is None)
        raise ValueError(
            f"{path}: columns {bare} name no 'block' while others do; the blocks are all on "
            "the columns (every column's 'block', no row's) or all on the rows"
        )
    return bool(named)


def _block(data: dict[str, Any], by_task: bool, where: str, on_columns: bool = False) -> str | None:
    """A row's ``block``: required, and one of the task table's, when the columns are tasks
    naming none (``on_columns``: they name theirs, and the row none)."""
    if "block" not in data:
        if by_task and not on_columns:
            raise ValueError(
                f"{where}: the columns are client tasks; give the row's 'block' "
                f"({' or '.join(_block_titles())}), which block of the task table its cells "
                "come from, or every column's"
            )
        return None
    block = _text(data, "block", where)
    if not by_task:
        raise ValueError(
            f"{where}: 'block' = {block!r} needs columns that name their client 'task'"
        )
    if on_columns:
        raise ValueError(
            f"{where}: 'block' = {block!r}, but the columns name their blocks; a row names "
            "none then (the blocks are all on the columns or all on the rows)"
        )
    return _known_block(data, where)


def _row_labels(data: dict[str, Any], columns: int, where: str) -> tuple[str | None, ...]:
    """A row's method per column: its ``method`` on every column, or ``methods`` (one per
    column, ``""`` where it has none), or none (``missing``); a row with a cell it cannot run
    says why in ``missing``, and a row running every cell has no ``missing``."""
    if "method" in data and "methods" in data:
        raise ValueError(f"{where}: give 'method' (every column) or 'methods' (one per column)")
    if "methods" in data:
        value = data["methods"]
        if not isinstance(value, list) or len(value) != columns:
            raise ValueError(f"{where}: 'methods' must list one label per column ({columns})")
        if not all(isinstance(item, str) for item in value):
            raise ValueError(f"{where}: 'methods' holds {value!r}; a label, or \"\" for none")
        if not any(value):
            raise ValueError(f"{where}: 'methods' names no method; give 'missing' alone")
        labels = tuple(item or None for item in value)
    elif "method" in data:
        labels = (_text(data, "method", where),) * columns
    else:
        labels = (None,) * columns
    missing = data.get("missing", "")
    if (None in labels) != bool(missing):
        raise ValueError(
            f"{where}: give 'missing' (why it is not here) exactly where a cell has no method "
            "('method' on every column, or \"\" in 'methods')"
        )
    return labels


def load_table(name: str, configs: Path = CONFIG_ROOT) -> PaperTable:
    """The declared table ``name``; ``ValueError`` names an unknown table or a bad entry."""
    path = tables_dir(configs) / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(table_names(configs)) or "none"
        raise ValueError(f"no table '{name}' (declared: {known})")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: {err}") from err
    columns = tuple(_column(c, f"{path} column {i}") for i, c in enumerate(data.get("columns", [])))
    if not columns:
        raise ValueError(f"{path}: no [[columns]]")
    by_task = _task_columns(columns, path)
    on_columns = _column_blocks(columns, path)
    rows = []
    for i, r in enumerate(data.get("rows", [])):
        where = f"{path} row {i} ({r.get('name', '?')})"
        rows.append(
            Row(
                _text(r, "name", where),
                _row_labels(r, len(columns), where),
                r.get("missing", ""),
                _paper_values(r.get("paper"), len(columns), where),
                _block(r, by_task, where, on_columns),
            )
        )
    if not rows:
        raise ValueError(f"{path}: no [[rows]]")
    for i, column in enumerate(columns):
        keys = [(row.block, row.labels[i]) for row in rows if row.labels[i] is not None]
        if len(set(keys)) != len(keys):
            where = "two rows of one block" if by_task else "two rows"
            raise ValueError(f"{path}: a method label appears in {where} of column {column.name!r}")
    reference = _text(data, "reference", str(path))
    if reference not in {label for row in rows for label in row.labels}:
        raise ValueError(f"{path}: reference '{reference}' is not a row's method")
    return PaperTable(
        key=name,
        paper=_text(data, "paper", str(path)),
        table=_text(data, "table", str(path)),
        title=_text(data, "title", str(path)),
        reference=reference,
        metric=_text(data, "metric", str(path)),
        columns=columns,
        rows=tuple(rows),
    )


def table_plan(table: PaperTable, stand_in: bool) -> str:
    """What a sweep of ``table`` runs, and which of its rows it cannot, for the user."""
    setting = "offline stand-ins" if stand_in else "the paper's settings"
    if table.columns[0].pair is not None:
        pairs = ", ".join(f"{c.name} = {c.pair_of(stand_in)}" for c in table.columns)
        columns = f"the pairs of {', '.join(table.setups(stand_in)) or 'none'}: {pairs}"
    elif table.columns[0].domain is not None:
        domains = ", ".join(
            f"{c.name} = {c.setup_of(stand_in) or 'none'} {c.domain_of(stand_in)}"
            for c in table.columns
        )
        columns = f"the client domains of {', '.join(table.setups(stand_in)) or 'none'}: {domains}"
    elif table.columns[0].task is None:
        columns = ", ".join(f"{c.name} = {c.setup_of(stand_in) or 'none'}" for c in table.columns)
    elif table.columns[0].block is not None:  # each column its setup's task at its block
        tasks = ", ".join(
            f"{c.name} = {c.setup_of(stand_in) or 'none'} {c.task_of(stand_in)} ({c.block})"
            for c in table.columns
        )
        unseen = all(c.block in _unseen_blocks() for c in table.columns)
        what = "the unseen test-time tasks" if unseen else "the client tasks"
        columns = f"{what} of {', '.join(table.setups(stand_in)) or 'none'}: {tasks}"
    else:
        tasks = ", ".join(f"{c.name} = {c.task_of(stand_in)}" for c in table.columns)
        columns = f"the client tasks of {', '.join(table.setups(stand_in)) or 'none'}: {tasks}"
    lines = [
        f"{table.paper}, {table.table} ({table.title}): {len(table.labels())} methods on "
        f"{setting}: {columns}"
    ]
    lines += [
        f"  not run: {row_title(row.name, row.block, table.missing_columns(row))}: {row.missing}"
        for row in table.missing()
    ]
    return "\n".join(lines)


def row_title(name: str, block: str | None, columns: list[str]) -> str:
    """A row's name, with its block where it has one (a method may be in two blocks) and the
    ``columns`` meant where not all of them."""
    where = [*([block] if block else []), *columns]
    return f"{name} ({', '.join(where)})" if where else name


def record_table(out: Path, table: PaperTable, stand_in: bool) -> None:
    """Write ``out/table.json``; ``ValueError`` when ``out`` holds another table or setting."""
    document = table.to_json(stand_in)
    earlier = read_table(out)
    if earlier is not None and (earlier["key"], earlier["setting"]) != (
        document["key"],
        document["setting"],
    ):
        raise ValueError(
            f"{out} holds table {earlier['key']} ({earlier['setting']} setting); give a new --out "
            f"for {document['key']} ({document['setting']})"
        )
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / TABLE_FILE, json.dumps(document, indent=2))


def read_table(folder: Path) -> dict[str, Any] | None:
    """The ``table.json`` a table sweep left in ``folder``, or None; ``ValueError`` when it is
    unreadable."""
    path = Path(folder) / TABLE_FILE
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text())
        document["key"], document["setting"], document["rows"], document["columns"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{path}: not a table record ({err}); remove it or rerun the sweep"
        ) from err
    return document
