"""Bit-for-bit regression of every registered method against another commit.

    git worktree add /tmp/before <old-commit>
    cp bench/regression.py /tmp/before/bench/
    (cd /tmp/before && /path/to/.venv/bin/python -m bench.regression run --out /tmp/old.json)
    python -m bench.regression run --out /tmp/new.json                # in this tree
    python -m bench.regression compare /tmp/old.json /tmp/new.json

``run`` takes the methods of the tree's registry (``fedfm_flower.methods.registry.METHODS``;
``--methods`` picks some) and runs each (method, setup, seed) cell of ``--seeds`` in a fresh Python
process (the real ServerApp loop and ClientApp in process, ``server_apps.inprocess``), so cells
cannot leak state into each other. The setup follows the method's modalities: a method that serves
images runs on digits-label-skew and digits-feature-skew (``configs/<method>/<setup>.toml``, else
fedavg's file with the method replaced), a text-only one on ``instructions``
(``configs/<method>/instructions.toml``), any other (multimodal only) on ``multitask-cpu``. Every
cell has a short schedule (``--rounds`` 4, ``--clients`` 4, 3 local steps, evaluation every round,
the per-setup and per-method overrides below, the same in both trees). A cell records its resolved
config, every client's per-round test metrics and train metrics (timings left out) and the
round's top-level ``test-accuracy*`` entries, floats as ``repr``. A cell that fails is recorded
with its error (exit status 1); ``--merge`` keeps the cells of an existing ``--out`` file and
replaces those run again. Use the same ``--cache-dir`` on both sides (one cached foundation model)
and the same environment: on a busy machine ``OMP_NUM_THREADS=1 MKL_NUM_THREADS=1`` on both (torch's
threads spin when cores are short; a cell then takes about a minute instead of five to thirteen).

**Privacy cells.** Besides the plain cells, ``run`` adds cells under DP and SecAgg+ (``--privacy``):
the variants of ``PRIVACY`` (``dp-central``: DP-FedAvg at a target epsilon; ``dp-local``: local DP
at a noise multiplier; ``secagg``: SecAgg+; ``secagg-dp-local``: both), each for the methods whose
``MethodSpec.capabilities`` take every mechanism it uses, on the method's first setup. With
``--privacy servers`` (the default: a run of every cell at two seeds takes hours on 2 cores) one
method per server half (``MethodSpec.strategy``) is run, the one its module is named after
(``strategies.fedavg``: fedavg), else the first in the registry: today fedavg for every variant
(``FedAvgStrategy``, the only server half that takes central DP or SecAgg+), and pfedpg and
pfedseq for local DP, 6 cells a seed. ``--privacy halves`` runs one method per pair of server
and client halves (34 cells a seed), ``--privacy all`` every method that takes a variant (50),
``--privacy none`` none. A privacy cell is keyed
``method+variant/setup/seed``. DP noise is drawn from OS entropy by design
(``fedfm_flower.privacy.noise``), so a privacy cell, in its own process and here only,
replaces ``noise.fresh_generator`` by a Philox generator keyed by (seed, index of the release),
and seeds Python's and NumPy's global generators with the seed (SecAgg+'s neighbour shuffle and
Flower's stochastic quantization read them); the cell records that it did (``privacy``). The
in-process run puts the server and the clients in one process, so the server's central noise and
the clients' local noise (``mechanism.add_gaussian_noise`` looks ``fresh_gaussian`` up at call
time, and that ``fresh_generator``) both come from it, in message order.

A round's record holds, besides the clients' metrics, the server's metrics (``server``: the
epsilon and releases under DP, ``secagg-clients``, ``update-norm-median``, ...) and the bytes
both ways (``bytes-*``, SecAgg+'s own included), all compared.

``compare`` prints a markdown table with one row per cell of either file: ``identical``,
``new`` (only in the new file; not a failure), ``missing`` (only in the old file), ``error: ...``
or the first differences (config keys, round, client, metric). Its exit status is 1 when any
cell is missing, failed or differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
IMAGE_SETUPS = ("digits-label-skew", "digits-feature-skew")
TEXT_SETUP = "instructions"
MULTIMODAL_SETUP = "multitask-cpu"
# For every cell (on top of --rounds and --clients).
COMMON: dict[str, Any] = {"local-steps": 3, "eval-every": 1}
# Per setup: on the language and multi-task data, a short foundation pretraining (cached, once
# per seed), generation and post-training schedule.
SHORT = {"pretrain-epochs": 2, "max-new-tokens": 4, "finetune-steps": 3, "test-fraction": 0.05}
SETUP_OVERRIDES: dict[str, dict[str, Any]] = {TEXT_SETUP: SHORT, MULTIMODAL_SETUP: SHORT}
# Per method: short schedules that still reach each method's server-side learner or last phase.
OVERRIDES: dict[str, dict[str, Any]] = {
    "pfedseq": {"pfedseq-warmup-rounds": 2, "pfedseq-seq-len": 2, "pfedseq-learner": "mamba"},
    "tap": {"tap-distill-steps": 3},
    "feddpa-t": {"feddpa-instances": 2},
    "feddpa-f": {"feddpa-instances": 2},
}
# Privacy variants: the mechanisms (``fedfm_flower.methods.MECHANISMS``) a method must take for
# it, and the settings it runs with (docs/privacy.md).
LOCAL_DP = {"dp": "local", "dp-clipping-norm": 0.5, "dp-noise-multiplier": 0.3}
SECAGG = {"secagg": True, "secagg-clipping-range": 1.0}
PRIVACY: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "dp-central": (
        ("central-dp",),
        {"dp": "central", "dp-clipping-norm": 0.5, "dp-target-epsilon": 50.0},
    ),
    "dp-local": (("local-dp",), LOCAL_DP),
    "secagg": (("secagg",), SECAGG),
    "secagg-dp-local": (("secagg", "local-dp"), {**SECAGG, **LOCAL_DP}),
}
PRIVACY_SELECTIONS = ("servers", "halves", "all", "none")
# Config keys that name places on disk, not settings.
PATH_KEYS = ("output-dir", "client-state-dir", "cache-dir", "run-name")


def registered_specs() -> list[tuple[str, Any]]:
    """(name, spec) of every registered method, for a registry that is a mapping or a sequence
    of specs (old and new ``fedfm_flower.methods.registry`` alike)."""
    from fedfm_flower.methods import registry

    entries: Iterable[tuple[str, Any]]
    if isinstance(registry.METHODS, Mapping):
        entries = registry.METHODS.items()
    else:
        entries = ((spec.name, spec) for spec in registry.METHODS)
    return [(getattr(spec, "name", name), spec) for name, spec in entries]


def registered_methods() -> list[tuple[str, tuple[str, ...]]]:
    """(name, modalities) of every registered method."""
    return [
        (name, tuple(getattr(spec, "modalities", ()) or ())) for name, spec in registered_specs()
    ]


def takes(spec: Any, mechanisms: tuple[str, ...]) -> bool:
    """Whether ``spec``'s capabilities take every one of ``mechanisms`` (a spec that declares
    none takes none)."""
    capabilities = getattr(spec, "capabilities", None)
    return capabilities is not None and all(capabilities.refusal(m) is None for m in mechanisms)


def privacy_cells(methods: list[str], selection: str) -> list[tuple[str, str]]:
    """(method, variant) of the privacy cells among ``methods``: those whose capabilities take
    the variant; with ``servers`` one per strategy half (the method its module is named after
    first), with ``halves`` the first of those with the same strategy and client halves."""
    if selection == "none":
        return []
    specs = dict(registered_specs())

    def namesake_first(method: str) -> bool:
        module = str(getattr(specs[method], "strategy", "")).partition(":")[0]
        return module.rpartition(".")[2] != method.replace("-", "_")

    ordered = sorted(methods, key=namesake_first) if selection == "servers" else methods
    cells = []
    for variant, (mechanisms, _) in PRIVACY.items():
        seen: set[tuple[str, ...]] = set()
        for method in ordered:
            spec = specs[method]
            halves = (getattr(spec, "strategy", method), getattr(spec, "client", method))
            kind = {"servers": halves[:1], "halves": halves}.get(selection, (method,))
            if takes(spec, mechanisms) and kind not in seen:
                seen.add(kind)
                cells.append((method, variant))
    return sorted(cells, key=lambda cell: (methods.index(cell[0]), list(PRIVACY).index(cell[1])))


def setups_for(modalities: tuple[str, ...]) -> tuple[str, ...]:
    """The setups a method with ``modalities`` (``()``: every one) runs on here."""
    if not modalities or "image" in modalities:
        return IMAGE_SETUPS
    if "text" in modalities:
        return (TEXT_SETUP,)
    return (MULTIMODAL_SETUP,)


def cell_run_config(
    method: str,
    setup: str,
    seed: int,
    rounds: int,
    clients: int,
    out: Path,
    cache_dir: str,
    variant: str = "",
) -> dict[str, Any]:
    """The run config of one cell: the method's config files, else fedavg's, plus overrides
    (and the privacy ``variant``'s settings, if any)."""
    from bench.compare_methods import cell_config

    own = ROOT / "configs" / method / f"{setup}.toml"
    shared = ROOT / "configs" / "setups" / f"{setup}.toml"
    base = method if own.is_file() or shared.is_file() else "fedavg"
    config = cell_config(base, setup, seed, rounds, clients, out)
    config.update({"method": method, "label": method, "run-name": f"{method}-{setup}-s{seed}"})
    config.update(COMMON)
    config.update(SETUP_OVERRIDES.get(setup, {}))
    config.update(OVERRIDES.get(method, {}))
    if variant:
        config.update(PRIVACY[variant][1])
        config["run-name"] = f"{method}+{variant}-{setup}-s{seed}"
    config["cache-dir"] = cache_dir
    return config


def seed_privacy_randomness(seed: int) -> str:
    """For a privacy cell, in its own process only: DP noise keyed by (``seed``, release index)
    instead of OS entropy, and Python's and NumPy's global generators seeded (SecAgg+); says
    what it replaced (recorded in the cell)."""
    import itertools
    import random

    import numpy as np

    from fedfm_flower.privacy import noise

    releases = itertools.count()

    def seeded_generator() -> np.random.Generator:
        return np.random.Generator(np.random.Philox(key=(seed << 64) | next(releases)))

    noise.fresh_generator = seeded_generator
    random.seed(seed)
    np.random.seed(seed)
    return (
        "bench only: noise.fresh_generator replaced by Philox keyed by (seed, release index); "
        "random and numpy.random seeded with the seed"
    )


def _numbers(metrics: Mapping[str, Any]) -> dict[str, str]:
    """``repr`` of each metric but timings, sorted by name."""
    return {k: repr(v) for k, v in sorted(metrics.items()) if not k.endswith("-seconds")}


def run_cell(
    method: str,
    setup: str,
    seed: int,
    rounds: int,
    clients: int,
    cache_dir: str,
    variant: str = "",
) -> dict[str, Any]:
    """One cell in this process: its config and its per-round numbers (a privacy ``variant``
    with its randomness seeded, ``seed_privacy_randomness``)."""
    from fedfm_flower.records.results import RunDirectory
    from server_apps.inprocess import run_in_process

    replaced = seed_privacy_randomness(seed) if variant else ""
    with tempfile.TemporaryDirectory(prefix="fedfm-regression-") as tmp:
        config = cell_run_config(
            method, setup, seed, rounds, clients, Path(tmp), cache_dir, variant
        )
        run_in_process(config, clients)
        records = RunDirectory(Path(tmp) / "runs" / config["run-name"]).rounds()
    return {
        **({"privacy": {"variant": variant, "randomness": replaced}} if variant else {}),
        "config": {k: repr(v) for k, v in sorted(config.items()) if k not in PATH_KEYS},
        "rounds": [
            {
                "round": r.get("round"),
                "phase": r.get("phase"),
                "accuracy": _numbers({k: v for k, v in r.items() if k.startswith("test-accuracy")}),
                "train": {c: _numbers(m) for c, m in sorted(r.get("train", {}).items())},
                "evaluate": {c: _numbers(m) for c, m in sorted(r.get("evaluate", {}).items())},
                "server": _numbers(r.get("server", {})),
                "bytes": _numbers({k: v for k, v in r.items() if k.startswith("bytes-")}),
            }
            for r in records
        ],
    }


def _child(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run one ``cell`` command in a fresh process; its record, or ``{"error": ...}``."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        try:
            done = subprocess.run(
                [*argv, result.name], cwd=ROOT, env=env, capture_output=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if done.returncode != 0:
            stderr = done.stderr.decode(errors="replace")
            print(stderr[-4000:], file=sys.stderr)
            return {"error": (stderr.strip().splitlines() or ["failed"])[-1]}
        return json.loads(Path(result.name).read_text())


def run_cells(
    out: Path,
    methods: list[str],
    seeds: list[int],
    rounds: int,
    clients: int,
    cache_dir: str,
    merge: bool = False,
    timeout: float = 900.0,
    privacy: str = "servers",
) -> dict[str, Any]:
    """Every cell of ``methods``, each in a fresh process, keyed 'method/setup/seed', then the
    privacy cells (``privacy_cells``), keyed 'method+variant/setup/seed'."""
    registered = dict(registered_methods())
    unknown = [m for m in methods if m not in registered]
    if unknown:
        raise SystemExit(f"not registered here: {', '.join(unknown)}")
    cells: dict[str, Any] = json.loads(out.read_text()) if merge and out.is_file() else {}
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    plain = [(m, "", setup) for m in methods for setup in setups_for(registered[m])]
    private = [
        (m, variant, setups_for(registered[m])[0]) for m, variant in privacy_cells(methods, privacy)
    ]
    for method, variant, setup in plain + private:
        for seed in seeds:
            key = f"{method}{'+' + variant if variant else ''}/{setup}/{seed}"
            start = time.perf_counter()
            argv = [sys.executable, "-m", "bench.regression", "cell", method, setup]
            argv += [str(seed), str(rounds), str(clients), cache_dir]
            argv += ["--variant", variant] if variant else []
            cells[key] = _child(argv, env, timeout)
            seconds = time.perf_counter() - start
            verdict = cells[key].get("error") or f"{len(cells[key]['rounds'])} rounds"
            print(f"[regression] {key}: {verdict} ({seconds:.1f} s)", flush=True)
            out.write_text(json.dumps(cells, indent=1))
    return cells


def _cell_diffs(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two records of one cell, most telling first."""
    if "error" in a or "error" in b:
        return [
            f"error ({side}): {c['error']}" for side, c in (("old", a), ("new", b)) if "error" in c
        ]
    diffs = [
        f"config {k}: {a['config'].get(k)} vs {b['config'].get(k)}"
        for k in sorted(a["config"].keys() | b["config"].keys())
        if a["config"].get(k) != b["config"].get(k)
    ]
    for x, y in zip(a["rounds"], b["rounds"], strict=False):
        where = f"round {x['round']}"
        if (x["round"], x["phase"]) != (y["round"], y["phase"]):
            diffs.append(f"{where}: {x['phase']} vs round {y['round']} {y['phase']}")
        for part in ("evaluate", "train"):
            for client in sorted(x[part].keys() | y[part].keys()):
                mine, theirs = x[part].get(client, {}), y[part].get(client, {})
                for name in sorted(mine.keys() | theirs.keys()):
                    if mine.get(name) != theirs.get(name):
                        diffs.append(
                            f"{where} {part} client {client} {name}: "
                            f"{mine.get(name)} vs {theirs.get(name)}"
                        )
        for part in ("accuracy", "server", "bytes"):
            mine, theirs = x.get(part, {}), y.get(part, {})
            for name in sorted(mine.keys() | theirs.keys()):
                if mine.get(name) != theirs.get(name):
                    diffs.append(f"{where} {name}: {mine.get(name)} vs {theirs.get(name)}")
    if len(a["rounds"]) != len(b["rounds"]):
        diffs.append(f"{len(a['rounds'])} vs {len(b['rounds'])} rounds")
    return diffs


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str]]:
    """(cell, 'identical' | 'new' | 'missing' | what differs) for every cell of either file."""
    rows = []
    for key in list(old) + [k for k in new if k not in old]:
        if key not in new:
            rows.append((key, "missing"))
        elif key not in old:
            rows.append(
                (key, "new" if "error" not in new[key] else f"new, error: {new[key]['error']}")
            )
        else:
            diffs = _cell_diffs(old[key], new[key])
            more = f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else ""
            rows.append((key, "identical" if not diffs else "; ".join(diffs[:3]) + more))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line: ``run``, ``compare`` (or ``cell``, one cell for ``run``'s child process)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--methods", nargs="+", default=None, help="default: every registered one")
    run.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    run.add_argument("--rounds", type=int, default=4)
    run.add_argument("--clients", type=int, default=4)
    run.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "fedfm-regcache"))
    run.add_argument("--merge", action="store_true", help="keep the other cells of --out")
    run.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
    run.add_argument(
        "--privacy", choices=PRIVACY_SELECTIONS, default="servers", help="which privacy cells"
    )
    cell = sub.add_parser("cell")
    for name, kind in (("method", str), ("setup", str), ("seed", int), ("rounds", int)):
        cell.add_argument(name, type=kind)
    for name, kind in (("clients", int), ("cache_dir", str), ("result", Path)):
        cell.add_argument(name, type=kind)
    cell.add_argument("--variant", default="", choices=("", *PRIVACY))
    cmp = sub.add_parser("compare")
    cmp.add_argument("old", type=Path)
    cmp.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    if args.command == "cell":
        record = run_cell(
            args.method,
            args.setup,
            args.seed,
            args.rounds,
            args.clients,
            args.cache_dir,
            args.variant,
        )
        args.result.write_text(json.dumps(record))
        return 0
    if args.command == "run":
        methods = args.methods or [name for name, _ in registered_methods()]
        cells = run_cells(
            args.out,
            methods,
            args.seeds,
            args.rounds,
            args.clients,
            args.cache_dir,
            args.merge,
            args.timeout,
            args.privacy,
        )
        return 1 if any("error" in c for c in cells.values()) else 0
    rows = compare(json.loads(args.old.read_text()), json.loads(args.new.read_text()))
    print("| method | setup | seed | result |\n|---|---|---|---|")
    for key, verdict in rows:
        method, setup, seed = key.split("/")
        print(f"| {method} | {setup} | {seed} | {verdict} |")
    return 0 if all(v in ("identical", "new") for _, v in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
