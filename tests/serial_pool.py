"""A serial cell pool for tests of the grid commands: cells queue in order and run, one at a
time, in ``next_done``, by the subclass's ``finish`` (no training: it writes what a run writes)."""

from __future__ import annotations

import json
from typing import Any

import pytest


class QueuePool:
    """One slot; ``next_done`` hands the oldest cell to ``finish`` and returns its record."""

    def __init__(self) -> None:
        self.queue: list = []
        self.ran: list[str] = []  # run names, in the order they ran

    def capacity(self) -> int:
        return 1

    def submit(self, cell) -> None:  # noqa: ANN001
        self.queue.append(cell)

    def pending(self) -> int:
        return len(self.queue)

    def next_done(self):  # noqa: ANN201
        cell = self.queue.pop(0)
        return cell, self.finish(cell)

    def finish(self, cell) -> dict[str, Any]:  # noqa: ANN001
        """Run (or reuse) ``cell``; its record."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Crash(RuntimeError):
    """A fake run's crash."""


class RunPool(QueuePool):
    """A serial pool whose cells run no training: round r of a cell gives ``curve(trial, r)``
    (its trial number, -1 for a final run; ``curve(trial, r, seed)`` with ``seeded``, a
    selection re-run being its trial's at another seed) as its mean validation accuracy,
    reported to the trial's pruner when the cell carries a link, as the runner does; each run
    writes the files a run writes, and its record is ``cell_record``'s. A curve value None
    crashes the run in that round (its earlier rounds written, no summary). A finished run is
    not run again."""

    def __init__(self, curve, card=None, seeded: bool = False) -> None:  # noqa: ANN001
        super().__init__()
        self._curve = curve
        self._card = card  # () -> the foundation card a run records now (None: no card)
        self._seeded = seeded

    def finish(self, cell) -> dict:  # noqa: ANN001
        from fedfm_flower.study.cells import cell_record, cell_state, failed_record

        if cell_state(cell) != "done":
            try:
                self._run(cell)
            except Crash as err:  # as cell_record reports a run that raised
                return {**failed_record(cell, str(err)), "state-before": "new", "seconds": 0.1}
        return cell_record(cell)

    def _run(self, cell) -> None:  # noqa: ANN001
        name = cell.config["run-name"]
        self.ran.append(name)
        number = int(name.split("-t")[-1][:3]) if "-t" in name else -1
        stop = cell.trial.early_stop() if cell.trial is not None else None
        rounds, clients = int(cell.config["num-server-rounds"]), int(cell.config["num-clients"])
        lines, stopped = [], {}
        cell.run_dir.mkdir(parents=True)
        recorded = {"run-config": cell.config}
        if self._card is not None:
            recorded["foundation"] = self._card()
        (cell.run_dir / "config.json").write_text(json.dumps(recorded))
        for r in range(1, rounds + 1):
            value = self._curve(number, r, cell.seed) if self._seeded else self._curve(number, r)
            if value is None:  # the run crashes in round r, its rounds before it written
                raise Crash(f"trial {number} crashed in round {r}")
            lines.append({"round": r, "clients-sampled": clients, "round-seconds": 0.5})
            lines[-1]["test-accuracy-mean"] = value
            with (cell.run_dir / "metrics.jsonl").open("a") as metrics:
                metrics.write(json.dumps(lines[-1]) + "\n")
            if stop is not None and stop(r, value) and r < rounds:
                stopped = {"stopped-at-round": r}
                break
        summary = {"primary-metric": "accuracy", "final-test-accuracy-mean": value, **stopped}
        (cell.run_dir / "summary.json").write_text(json.dumps(summary))


def tune_pools(
    monkeypatch: pytest.MonkeyPatch,
    curve,  # noqa: ANN001
    card=None,  # noqa: ANN001
    seeded: bool = False,
) -> list[RunPool]:
    """The pools ``tune.main`` makes from now on, one ``RunPool(curve, card, seeded)`` per
    command."""
    from fedfm_flower.study import tune

    pools: list[RunPool] = []

    def pool(args) -> RunPool:  # noqa: ANN001
        pools.append(RunPool(curve, card, seeded))
        return pools[-1]

    monkeypatch.setattr(tune, "pool_from_arguments", pool)
    return pools
