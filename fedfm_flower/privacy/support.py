"""Which methods can take central or local differential privacy or SecAgg+, and why the others
cannot.

Central DP noises the *aggregate* of the shared updates, so it fits a method whose server needs
only that average of the clients' shared tensors: the methods on ``FedAvgStrategy`` whose
clients send their trained shared tensors. A method whose server reads each client's update,
or averages parts over subsets of the clients, is refused at start with the reason.

Local DP noises each client's update before it leaves the client, so whatever the server does
with it is post-processing: it fits every method whose clients send, in the federated rounds
only, their shared tensors or their updates (the FedAvg family, FedDPA, TAP, pFedSeq,
pFedPG); a post-training round (FedDPA-F's, TAP's) must send nothing up (the ClientApp refuses
otherwise). The others are refused. Each method
declares which it takes and why not the others (``MethodSpec.capabilities``); this module reads
them and renders docs/privacy.md's table from them. Light: the config reads it in every process.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from fedfm_flower.methods import MECHANISMS
from fedfm_flower.methods.registry import METHODS, method_spec

if TYPE_CHECKING:
    from fedfm_flower.methods.settings import RunConfig

DP_MODES: tuple[str, ...] = ("none", "central", "local")


def dp_refusal(config: RunConfig) -> str | None:
    """Why ``config``'s method cannot take its ``dp`` mode, or None when it can (or dp = none)."""
    if config.dp == "central":
        return central_dp_refusal(config)
    if config.dp == "local":
        return local_dp_refusal(config)
    return None


def local_dp_refusal(config: RunConfig) -> str | None:
    """Why ``config``'s method cannot take local DP, or None when it can."""

    return method_spec(config.method).capabilities.local_dp


def central_dp_refusal(config: RunConfig) -> str | None:
    """Why ``config``'s method cannot take central DP, or None when it can."""

    return method_spec(config.method).capabilities.central_dp


def secagg_refusal(config: RunConfig) -> str | None:
    """Why ``config``'s run cannot take SecAgg+, or None when it can."""

    refusal = method_spec(config.method).capabilities.secagg
    if refusal is not None:
        return refusal
    if config.dataset == "multitask":
        return "on 'multitask' each component is averaged over its owners only, not one sum"
    if config.dp == "central":
        return (
            "central DP clips each client's update on the server, which SecAgg+ hides; use "
            "dp = 'local' with it"
        )
    return None


TABLE_BEGIN, TABLE_END = "<!-- capabilities:begin -->", "<!-- capabilities:end -->"


def capability_table() -> str:
    """The methods' capabilities as a markdown table, methods that declare the same in one row
    (docs/privacy.md holds it between ``TABLE_BEGIN`` and ``TABLE_END``)."""

    rows: dict[tuple[str | None, ...], list[str]] = {}
    for name, spec in METHODS.items():
        key = tuple(spec.capabilities.refusal(m) for m in MECHANISMS)
        rows.setdefault(key, []).append(name)
    lines = ["| method | central DP | local DP | SecAgg+ |", "|---|---|---|---|"]
    for refusals, names in sorted(rows.items(), key=lambda row: sum(map(bool, row[0]))):
        cells = [_cell(refusal) for refusal in refusals]
        lines.append(f"| {', '.join(names)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(refusal: str | None) -> str:
    if refusal is None:
        return "supported"
    return refusal if refusal.startswith("not yet") else f"no: {refusal}"


def with_table(text: str) -> str:
    """``text`` (docs/privacy.md) with the block between the markers replaced by the table."""
    head, begin, rest = text.partition(TABLE_BEGIN)
    _, end, tail = rest.partition(TABLE_END)
    if not begin or not end:
        raise ValueError(f"the text has no {TABLE_BEGIN} ... {TABLE_END} block")
    return f"{head}{TABLE_BEGIN}\n{capability_table()}{TABLE_END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """``python -m fedfm_flower.privacy.support [--write FILE]``: print the table, or replace
    it in FILE (docs/privacy.md)."""

    parser = argparse.ArgumentParser(description="the methods' privacy capabilities")
    parser.add_argument("--write", type=Path, help="replace the table's block in this file")
    args = parser.parse_args(argv)
    if args.write is None:
        print(capability_table(), end="")
        return 0
    args.write.write_text(with_table(args.write.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
