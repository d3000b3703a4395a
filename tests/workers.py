"""How the suite splits over pytest-xdist workers (``scripts/test.sh`` runs 2; the scheduler is
``tests/conftest.py``'s): the tests that start real processes are one unit of work."""

from __future__ import annotations

# The modules whose tests start real processes (a SuperLink and SuperNodes, Ray, forked
# workers, Flower's CLI) and wait on them. Under pytest-xdist (scripts/test.sh runs 2 workers)
# they are one unit of work, run one after another by one worker, so no two of them compete for
# the cores while the other worker takes the in-process tests, one at a time as it frees up.
PROCESS_MODULES = frozenset(
    {
        "test_bench",
        "test_chaos",
        "test_deploy_superlink",
        "test_deploy_supernode",
        "test_deployment",
        "test_failures",
        "test_faults",
        "test_fork_engine",
        "test_forkserver",
        "test_large_messages",
        "test_ray_cells",
        "test_secagg",
        "test_simulation",
        "test_startup",
        "test_warm_executor",
        "test_warm_worker",
    }
)


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: ``processes`` for ``PROCESS_MODULES``, else the test."""
    module = nodeid.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")
    return "processes" if module in PROCESS_MODULES else nodeid
