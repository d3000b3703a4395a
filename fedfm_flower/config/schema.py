"""The run-config schema as a whole, and the copies generated from it.

Every key is declared once with ``setting(...)``: the common keys in the groups of
``fedfm_flower.config.keys`` and ``fedfm_flower.models.tuners.keys`` (``config.GROUPS``), a
method's own keys in its ``MethodSettings`` class. From these declarations this module writes the
``[tool.flwr.app.config]`` table of ``pyproject.toml`` (Flower rejects overrides of keys that are
not there) and the key tables of docs/configuration.md, each between a
``<!-- keys: GROUP ... -->`` and a ``<!-- /keys -->`` line; tests fail when a committed copy
differs. Regenerate both with::

    python -m fedfm_flower.config.schema --write
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedfm_flower.config.experiment import GROUPS
from fedfm_flower.methods.registry import settings_classes

WRITE_COMMAND = "python -m fedfm_flower.config.schema --write"
TABLE_HEADER = "[tool.flwr.app.config]"
DOCS_END = "<!-- /keys -->"
_DOCS_BLOCK = re.compile(r"<!-- keys: ([a-z0-9 -]+) -->\n(.*?)" + re.escape(DOCS_END), re.DOTALL)


@dataclass(frozen=True)
class Key:
    """One run-config key: its name, default (whose type is the key's type) and meaning."""

    name: str
    default: Any
    doc: str


@dataclass(frozen=True)
class KeyGroup:
    """Keys declared together: a group of common keys or one method's settings."""

    name: str
    title: str
    source: str  # the module that declares the keys
    keys: tuple[Key, ...]


def key_groups() -> tuple[KeyGroup, ...]:
    """Every key group in order: the common groups (``config.GROUPS``), then each registered
    method's settings."""

    groups = []
    for group in GROUPS:
        keys = tuple(
            Key(f.name.replace("_", "-"), f.default, f.metadata.get("doc", ""))
            for f in dataclasses.fields(group)
        )
        groups.append(KeyGroup(group.group, group.title, group.__module__, keys))
    for kind in settings_classes():
        keys = tuple(
            Key(kind.key_of(f.name), f.default, f.metadata.get("doc", ""))
            for f in dataclasses.fields(kind)
        )
        groups.append(KeyGroup(kind.prefix, kind.prefix, kind.__module__, keys))
    return tuple(groups)


def toml_value(value: Any) -> str:
    """``value`` (bool, int, float or str) written as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string (JSON's escapes are TOML's)
    return repr(value)


# ---------------------------------------------------------------------- pyproject.toml
def pyproject_table() -> str:
    """The ``[tool.flwr.app.config]`` table: every key with its default, grouped."""
    lines = [TABLE_HEADER]
    for group in key_groups():
        lines.append(f"# {group.title} ({group.source})")
        lines.extend(f"{key.name} = {toml_value(key.default)}" for key in group.keys)
    return "\n".join(lines) + "\n"


def with_pyproject_table(text: str) -> str:
    """``text`` (pyproject.toml) with its ``[tool.flwr.app.config]`` table regenerated and
    everything else untouched."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == TABLE_HEADER]
    if len(starts) != 1:
        raise ValueError(f"pyproject.toml must have one {TABLE_HEADER} table")
    start = starts[0]
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")),
        len(lines),
    )
    tail = "\n" if end < len(lines) else ""  # one blank line before the next table
    return "".join(lines[:start]) + pyproject_table() + tail + "".join(lines[end:])


# ---------------------------------------------------------------------- docs/configuration.md
def docs_table(names: list[str], groups: dict[str, KeyGroup] | None = None) -> str:
    """The markdown table of the keys of the groups ``names``, in that order."""
    groups = groups if groups is not None else {g.name: g for g in key_groups()}
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for name in names:
        rows.extend(
            f"| `{key.name}` | `{toml_value(key.default)}` | {key.doc} |"
            for key in groups[name].keys
        )
    return "\n".join(rows) + "\n"


def with_docs_tables(text: str) -> str:
    """``text`` (docs/configuration.md) with every ``<!-- keys: GROUP ... -->`` block's table
    regenerated; every group must have exactly one block, and the prose around them stays."""
    groups = {g.name: g for g in key_groups()}
    seen: list[str] = []

    def table(match: re.Match[str]) -> str:
        names = match.group(1).split()
        unknown = [name for name in names if name not in groups]
        if unknown:
            raise ValueError(f"docs name key groups that do not exist: {', '.join(unknown)}")
        seen.extend(names)
        return f"<!-- keys: {' '.join(names)} -->\n{docs_table(names, groups)}{DOCS_END}"

    text = _DOCS_BLOCK.sub(table, text)
    missing = [name for name in groups if name not in seen]
    twice = sorted({name for name in seen if seen.count(name) > 1})
    if missing or twice:
        raise ValueError(
            f"every key group needs one '<!-- keys: GROUP -->' ... '{DOCS_END}' block in "
            f"docs/configuration.md; missing: {', '.join(missing) or '-'}; "
            f"more than once: {', '.join(twice) or '-'}"
        )
    return text


# ---------------------------------------------------------------------- the command
GENERATED = {"pyproject.toml": with_pyproject_table, "docs/configuration.md": with_docs_tables}


def stale_files(root: Path) -> list[str]:
    """The generated files under ``root`` whose committed copy differs from the schema's."""
    stale = []
    for name, regenerate in GENERATED.items():
        text = (root / name).read_text()
        if regenerate(text) != text:
            stale.append(name)
    return stale


def main(argv: list[str] | None = None) -> int:
    """``python -m fedfm_flower.config.schema [--write | --check] [--root DIR]``: print the
    ``[tool.flwr.app.config]`` table, rewrite the generated copies, or list the stale ones."""

    parser = argparse.ArgumentParser(description="the run-config schema and its copies")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="rewrite the generated copies")
    action.add_argument("--check", action="store_true", help="exit 1 if a copy is stale")
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository root")
    args = parser.parse_args(argv)
    if args.write:
        for name, regenerate in GENERATED.items():
            path = args.root / name
            path.write_text(regenerate(path.read_text()))
        return 0
    if args.check:
        stale = stale_files(args.root)
        for name in stale:
            print(f"{name} is stale; run: {WRITE_COMMAND}")
        return 1 if stale else 0
    print(pyproject_table(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
