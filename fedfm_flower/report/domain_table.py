"""pFedPG's Table 1 layout: the final metric per client domain, one federation per dataset.

For the runs of a setup, a client's domain comes from the run's ``config.json``: its
``client-domains`` map (partition -> domain), which the runner stores for image data whose
clients each hold one domain (``fedfm_flower.data.client_domains``: the natural id of a
``natural-id`` or ``domain-dirichlet`` partition, e.g. an image folder's domain folder, or
the synthetic domain of ``digits-domains``). A client's partition is the one its node reported
(``task_table.client_partitions``); a run without the map names each client ``client <id>``.

A seed's value of a domain is the mean over that run's clients of the domain of the run's
final metric (its main metric: test accuracy for image classification); a seed's value of
several domains (an ``Average`` column) is the mean of their values, each domain weighing the
same, only for seeds whose run has every one of them. A cell is the mean over seeds, in
percent, with the half-width of its Student-t 95% interval
(``fedfm_flower.study.statistics.mean_ci``), as in the main table and the per-pair table; a
seed whose run has no client of the domain does not count in the cell.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedfm_flower.report.runs import RunResult
from fedfm_flower.report.tables import Cell
from fedfm_flower.report.task_table import stored_by_client, task_values
from fedfm_flower.study.statistics import mean_ci

STORED_DOMAINS = "client-domains"  # config.json key: {partition: domain name}


@dataclass(frozen=True)
class DomainTable:
    """One setup's per-domain values: the domains (by first client) and, per method and seed,
    {domain: the mean over its clients of the final metric}."""

    setup: str
    domains: tuple[str, ...]
    per_seed: dict[str, dict[int, dict[str, float]]]  # label -> seed -> domain -> value


def client_domains(path: Path, clients: Sequence[int]) -> dict[int, str]:
    """{client id: domain} of the run at ``path`` (stored by partition; ``client <id>`` where
    the run stored none)."""
    named, _, _ = stored_by_client(path, STORED_DOMAINS, clients)
    return {client: named.get(client, f"client {client}") for client in clients}


def build_domain_table(runs: Sequence[RunResult], setup: str) -> DomainTable | None:
    """The per-domain values of ``setup``'s runs with final values; None when it has none."""
    chosen = [r for r in runs if r.setup == setup and r.final]
    if not chosen:
        return None
    first_client: dict[str, int] = {}
    per_seed: dict[str, dict[int, dict[str, float]]] = {}
    for run in chosen:
        domains = client_domains(run.path, sorted(run.final))
        for client, domain in domains.items():
            first_client[domain] = min(client, first_client.get(domain, client))
        per_seed.setdefault(run.label, {})[run.seed] = task_values(run, domains, run.metric)
    return DomainTable(setup, tuple(sorted(first_client, key=first_client.__getitem__)), per_seed)


def domain_cell(
    table: DomainTable | None, label: str, domains: Sequence[str], scale: float = 100.0
) -> Cell | None:
    """The cell of ``label`` over ``domains`` (one: that domain; several: each seed's mean of
    them, seeds with all of them); None where no seed has them."""
    if table is None or not domains:
        return None
    by_seed = table.per_seed.get(label, {})
    seeds = tuple(s for s in sorted(by_seed) if all(d in by_seed[s] for d in domains))
    if not seeds:
        return None
    values = [scale * statistics.fmean(by_seed[s][d] for d in domains) for s in seeds]
    mean, ci = mean_ci(values)
    return Cell(table.setup, label, seeds, mean, ci, None)
