"""FedDPA's federated Flan datasets (its Appendix A.1, Table 5), read from the authors' files.

FedDPA builds two federated datasets from Flan, 8 tasks each, one task per client, 300 training
and 200 test examples per client. This module reads them for users who have them; nothing here
is downloaded unless ``data-dir`` names a Hub dataset (below).

Layout. The authors' code (Lydia-yang/FedDPA, ``code/fed_utils/client.py``) reads client ``i``'s
training data from ``local_training_{i}.json`` in one directory per federated dataset and
client count (``<data_path>/<num_clients>/``, e.g. ``data/dataset1/8``), with
``datasets.load_dataset("json", data_files=...)``. ``data-dir`` is that directory: it must hold
``local_training_{i}.json`` for every client ``i`` in ``0..N-1`` (``N`` clients, ``num-clients``
must be ``N``) and each client's test examples as ``local_test_{i}.json`` (or
``local_testing_{i}.json``). The authors evaluate on one pooled test file instead
(``data/dataset1/flan_test_200_selected_nstrict_1.jsonl``, grouped by its ``category``), so when
a client has no test file of its own, a single ``flan_test*.json``/``.jsonl`` in ``data-dir`` or
its parent directory is used: the client's test examples are its records of the client's task.
``.jsonl`` is accepted wherever ``.json`` is. A file is a JSON list of records or JSON lines
(what ``load_dataset("json")`` reads). A record has ``instruction`` and ``output`` (strings), an
optional ``input`` (FedDPA's instructions already contain the instance text) and, usually,
``category`` (or ``task``), the Flan task. A client's task is the most common ``category``
(or ``task``) of its training records, ``client-{i}`` when they have none; each example keeps its
own record's category. The files give the splits: ``test-fraction`` and ``public-fraction`` are
not used, and there is no public split.

Unseen tasks. ``flan_unseen_tests`` reads run config ``unseen-test-dir`` (FedDPA's Table 14): a
directory of test files of tasks outside the federation, in the same record format, one task per
file, named as a client's task (its records' most common category, else the file's name).

Hub. When ``data-dir`` is not an existing directory but looks like a Hub dataset id
(``owner/name``: one ``/``, not starting with ``.``, ``/`` or ``~``), it is read with
``datasets.load_dataset(name)``: splits ``train`` and ``test``, and a ``task`` or ``category``
column whose values, in sorted order, are the clients (client ``i`` holds the ``i``-th task's
records). Offline, the name must already be in the local Hugging Face cache.

Imports inside functions keep ``datasets`` out of this module's start-up.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedfm_flower.data.instructions import Example
from fedfm_flower.data.registry import looks_like_hub_name

TRAIN_FILE = "local_training_{}.json"
TEST_FILES = ("local_test_{}.json", "local_testing_{}.json")
POOLED_TEST_GLOB = "flan_test*.json*"
TASK_KEYS = ("category", "task")  # the record's Flan task, first found wins
_TRAIN_PATTERN = re.compile(r"local_training_(\d+)\.jsonl?")


def flan_num_clients(data_dir: str) -> int:
    """How many clients the federated dataset at ``data_dir`` has (training files or tasks)."""
    if _is_hub(data_dir):
        return len(_hub_clients(data_dir))
    return len(_train_files(_directory(data_dir)))


def flan_client_task(data_dir: str, partition_id: int) -> str:
    """Client ``partition_id``'s task: its records' most common category, else ``client-{i}``."""
    if _is_hub(data_dir):
        clients = _hub_clients(data_dir)
        _check_partition(partition_id, len(clients))
        return clients[partition_id][0]
    files = _train_files(_directory(data_dir))
    _check_partition(partition_id, len(files))
    return _task_of(_read_records(files[partition_id]), partition_id)


def flan_client_split(
    data_dir: str, partition_id: int, num_partitions: int
) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """(train, test) examples of client ``partition_id`` of the dataset at ``data_dir``."""
    if _is_hub(data_dir):
        clients = _hub_clients(data_dir)
        _check_count(data_dir, num_partitions, len(clients), "tasks")
        _check_partition(partition_id, num_partitions)
        return clients[partition_id][1], clients[partition_id][2]
    directory = _directory(data_dir)
    files = _train_files(directory)
    _check_count(data_dir, num_partitions, len(files), "client training files")
    _check_partition(partition_id, num_partitions)
    train_records = _read_records(files[partition_id])
    task = _task_of(train_records, partition_id)
    train = _examples(train_records, files[partition_id], task)
    test_file = _client_test_file(directory, partition_id)
    if test_file is not None:
        test = _examples(_read_records(test_file), test_file, task)
    else:
        test = _pooled_test(directory, partition_id, len(files), task)
    return train, test


def flan_unseen_tests(unseen_dir: str) -> tuple[tuple[str, tuple[Example, ...]], ...]:
    """(task, test examples) per test-time task outside the federation, tasks sorted: every
    ``*.json``/``*.jsonl`` file of ``unseen_dir`` (run config ``unseen-test-dir``) holds one task's
    test examples, the task named as a client's, by its records' most common ``category`` (or
    ``task``), else by the file's name without suffix; files of one task pool, and every example
    counts as the file's task whatever its own record says."""
    directory = Path(unseen_dir).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"run config 'unseen-test-dir' = {unseen_dir!r}: no such directory")
    files = sorted(
        path
        for path in directory.iterdir()
        if path.suffix in (".json", ".jsonl") and path.is_file()
    )
    if not files:
        raise ValueError(
            f"run config 'unseen-test-dir' = {unseen_dir!r} holds no .json or .jsonl test file"
        )
    by_task: dict[str, list[Example]] = {}
    for path in files:
        records = _read_records(path)
        if not records:
            raise ValueError(f"run config 'unseen-test-dir': {path} holds no record")
        task = _most_common_task(records) or path.name.split(".")[0]
        examples = _examples(records, path, task)
        by_task.setdefault(task, []).extend(replace(e, task=task) for e in examples)
    return tuple((task, tuple(by_task[task])) for task in sorted(by_task))


# --- local files ------------------------------------------------------------------------------


def _is_hub(data_dir: str) -> bool:
    return not Path(data_dir).expanduser().is_dir() and looks_like_hub_name(data_dir)


def _directory(data_dir: str) -> Path:
    if not data_dir:
        raise ValueError(
            "run config 'data-dir' = '' is invalid for dataset 'flan': name the directory "
            "holding local_training_{i}.json per client (FedDPA's data/dataset1/8) or a Hub "
            "dataset id"
        )
    directory = Path(data_dir).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(
            f"run config 'data-dir' = {data_dir!r} is invalid for dataset 'flan': no such "
            "directory (expected one holding local_training_{i}.json per client)"
        )
    return directory


def _find(directory: Path, name: str) -> Path | None:
    """``directory/name``, or its ``.jsonl`` twin, when either is a file."""
    for candidate in (name, name + "l"):
        if (directory / candidate).is_file():
            return directory / candidate
    return None


def _train_files(directory: Path) -> list[Path]:
    """Client i's training file at index i; every index 0..N-1 must have one."""
    indices = {
        int(match.group(1))
        for path in directory.iterdir()
        if (match := _TRAIN_PATTERN.fullmatch(path.name)) and path.is_file()
    }
    if not indices:
        raise FileNotFoundError(
            f"dataset 'flan': no client training files in {directory} (expected "
            "local_training_0.json, local_training_1.json, ...)"
        )
    files = []
    for index in range(max(indices) + 1):
        path = _find(directory, TRAIN_FILE.format(index))
        if path is None:
            raise FileNotFoundError(
                f"dataset 'flan': missing {TRAIN_FILE.format(index)} for client {index} in "
                f"{directory}, which has {len(indices)} client training files (indices "
                f"{_ranges(sorted(indices))}); clients must be numbered 0..N-1"
            )
        files.append(path)
    return files


def _client_test_file(directory: Path, partition_id: int) -> Path | None:
    for name in TEST_FILES:
        path = _find(directory, name.format(partition_id))
        if path is not None:
            return path
    return None


def _pooled_test(
    directory: Path, partition_id: int, clients: int, task: str
) -> tuple[Example, ...]:
    """Client ``partition_id``'s records of a pooled ``flan_test*`` file (the authors' layout)."""
    pooled = sorted(
        {
            path
            for folder in (directory, directory.parent)
            for path in folder.glob(POOLED_TEST_GLOB)
            if path.suffix in (".json", ".jsonl") and path.is_file()
        }
    )
    names = " or ".join(name.format(partition_id) for name in TEST_FILES)
    if not pooled:
        raise FileNotFoundError(
            f"dataset 'flan': missing {names} for client {partition_id} in {directory}, which "
            f"has {clients} clients, and no pooled flan_test*.json(l) beside it"
        )
    if len(pooled) > 1:
        raise ValueError(
            f"dataset 'flan': client {partition_id} has no {names} in {directory} and several "
            f"pooled test files could serve: {', '.join(map(str, pooled))}; keep one"
        )
    examples = _examples(_read_records(pooled[0]), pooled[0], None)
    mine = tuple(example for example in examples if example.task == task)
    if not mine:
        found = sorted({example.task for example in examples})
        raise ValueError(
            f"dataset 'flan': the pooled test file {pooled[0]} has no record of client "
            f"{partition_id}'s task {task!r} (its categories: {', '.join(found)}); give the "
            f"client {names}"
        )
    return mine


def _read_records(path: Path) -> list[Any]:
    """The records of a JSON list or JSON-lines file (parsed once per file version)."""
    stat = path.stat()
    return _parse(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _parse(path: str, mtime_ns: int, size: int) -> list[Any]:
    text = Path(path).read_text(encoding="utf-8").strip()
    if text.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"dataset 'flan': {path} is not valid JSON: {err}") from err
        return records
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"dataset 'flan': line {number} of {path} is not valid JSON (expected a "
                    f"JSON list or JSON lines): {err}"
                ) from err
    return records


# --- records -> examples ----------------------------------------------------------------------


def _record_task(record: Mapping[str, Any]) -> str | None:
    for key in TASK_KEYS:
        value = record.get(key)
        if value not in (None, ""):
            return str(value)
    return None


def _task_of(records: Sequence[Any], partition_id: int) -> str:
    """The most common task of ``records`` (the first seen on ties), else ``client-{i}``."""
    return _most_common_task(records) or f"client-{partition_id}"


def _most_common_task(records: Sequence[Any]) -> str | None:
    """The most common task of ``records`` (the first seen on ties), None when they have none."""
    tasks = Counter(
        task for record in records if isinstance(record, Mapping) and (task := _record_task(record))
    )
    return tasks.most_common(1)[0][0] if tasks else None


def _examples(records: Sequence[Any], source: Path | str, task: str | None) -> tuple[Example, ...]:
    """Examples of ``records``; each keeps its own task, else takes ``task``."""
    examples = []
    for index, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise ValueError(f"dataset 'flan': record {index} of {source} is not a JSON object")
        for key in ("instruction", "output"):
            if not isinstance(record.get(key), str):
                raise ValueError(
                    f"dataset 'flan': record {index} of {source} has no {key!r} string (keys: "
                    f"{', '.join(map(str, record)) or 'none'})"
                )
        text = record.get("input")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"dataset 'flan': record {index} of {source}: 'input' is no string")
        own = _record_task(record) or task
        if own is None:
            raise ValueError(
                f"dataset 'flan': record {index} of {source} has no 'category' or 'task'"
            )
        examples.append(Example(own, record["instruction"], text or "", record["output"]))
    return tuple(examples)


# --- the Hub ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _hub_clients(name: str) -> tuple[tuple[str, tuple[Example, ...], tuple[Example, ...]], ...]:
    """(task, train, test) per client of Hub dataset ``name``, tasks in sorted order."""
    try:
        import datasets

        loaded = datasets.load_dataset(name)
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds; all mean "not here"
        raise FileNotFoundError(
            f"run config 'data-dir' = {name!r}: no such directory, and loading it as a Hugging "
            f"Face Hub dataset failed: {err} (offline, the name must be in the local Hugging "
            "Face cache)"
        ) from err
    missing = [split for split in ("train", "test") if split not in loaded]
    if missing:
        raise ValueError(
            f"dataset 'flan': Hub dataset {name!r} lacks split(s) {', '.join(missing)} "
            f"(has: {', '.join(loaded)})"
        )
    columns = loaded["train"].column_names
    column = next((key for key in ("task", "category") if key in columns), None)
    if column is None:
        raise ValueError(
            f"dataset 'flan': Hub dataset {name!r} has no 'task' or 'category' column to group "
            f"its records into clients (columns: {', '.join(columns)})"
        )
    splits = {}
    for split in ("train", "test"):
        if column not in loaded[split].column_names:
            raise ValueError(
                f"dataset 'flan': Hub dataset {name!r}'s {split} split lacks {column!r}"
            )
        records = [{**record, "task": record[column]} for record in loaded[split]]
        splits[split] = _examples(records, f"{name} ({split} split)", None)
    tasks = sorted({example.task for example in splits["train"]})
    return tuple(
        (
            task,
            tuple(e for e in splits["train"] if e.task == task),
            tuple(e for e in splits["test"] if e.task == task),
        )
        for task in tasks
    )


# --- checks -----------------------------------------------------------------------------------


def _check_count(data_dir: str, num_partitions: int, clients: int, what: str) -> None:
    if num_partitions != clients:
        raise ValueError(
            f"dataset 'flan': {num_partitions} clients (num-clients / num-partitions) but "
            f"data-dir {data_dir!r} has {clients} {what}; use {clients} clients"
        )


def _check_partition(partition_id: int, clients: int) -> None:
    if not 0 <= partition_id < clients:
        raise ValueError(f"partition_id {partition_id} is not in [0, {clients})")


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    start = previous = indices[0]
    for index in [*indices[1:], None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if index is not None:
            start = previous = index
    return ", ".join(parts)
