"""``flower-supernode`` with its fixed waits shortened: the SuperNode of a low-latency federation.

    python -m fedfm_flower.deploy.supernode [--poll-interval 0.1] <flower-supernode arguments>

Flower's SuperNode (1.41, 1.42) waits in fixed steps that its command line cannot change
(``flwr.supernode.start_client_internal``):

* 3 s after every pull from the SuperLink that found no message, so a message waits 1.5 s on
  average, up to 3 s, before the node sees it;
* 0.5 s between looks for its ClientApp's reply.

Its SuperExec then looks for the message's task every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``
seconds (Flower's own setting, default 1 s). On loopback these waits are most of a round.

This entry point runs Flower's own ``flower-supernode`` unchanged except that those sleeps last
at most ``--poll-interval`` seconds, and sets ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` to the same
value unless the environment sets it. Protocol, messages and results are Flower's: only the
idle waits are shorter, at the price of more pulls (10 per second per node at 0.1 s).

The change replaces the ``time`` name inside that one Flower module by a view of ``time`` whose
``sleep`` is capped; it is applied only to the Flower versions it was written against. With
any other version the SuperNode runs with Flower's own waits and says so on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

# Flower versions whose SuperNode loop is known to sleep through `time.sleep` in that module.
KNOWN_FLOWER = ("1.41.", "1.42.")
LOOP_MODULE = "flwr.supernode.start_client_internal"
SUPEREXEC_POLL_VAR = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
DEFAULT_POLL_INTERVAL = 0.1
# Flower's own bounds for FLWR_SUPEREXEC_TASK_POLL_INTERVAL.
MIN_POLL_INTERVAL, MAX_POLL_INTERVAL = 0.01, 60.0


class CappedSleep:
    """The ``time`` module as the SuperNode loop sees it: ``sleep`` lasts at most ``cap`` s."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def sleep(self, seconds: float) -> None:
        """Sleep ``min(seconds, cap)``."""
        time.sleep(min(seconds, self.cap))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def check_poll_interval(seconds: float) -> float:
    """``seconds`` if it is a usable poll interval, else ValueError naming it."""
    if not (math.isfinite(seconds) and MIN_POLL_INTERVAL <= seconds <= MAX_POLL_INTERVAL):
        raise ValueError(
            f"poll interval must be a number of seconds in [{MIN_POLL_INTERVAL}, "
            f"{MAX_POLL_INTERVAL}], got {seconds!r}"
        )
    return seconds


def shorten_waits(cap: float) -> bool:
    """Cap the SuperNode loop's sleeps at ``cap`` s; False, changing nothing, on another Flower."""
    version = importlib.metadata.version("flwr")
    loop = importlib.import_module(LOOP_MODULE)
    current = getattr(loop, "time", None)
    if isinstance(current, CappedSleep):
        current.cap = cap
        return True
    if not version.startswith(KNOWN_FLOWER) or current is not time:
        print(
            f"fedfm_flower.deploy.supernode: Flower {version} is not one whose SuperNode waits "
            f"are known ({', '.join(v + 'x' for v in KNOWN_FLOWER)}); running with its own "
            "waits",
            file=sys.stderr,
        )
        return False
    loop.time = CappedSleep(cap)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``--poll-interval``, shorten the waits, then run ``flower-supernode`` on the rest."""
    parser = argparse.ArgumentParser(
        prog="python -m fedfm_flower.deploy.supernode",
        description=__doc__.splitlines()[0],
        epilog="Every other argument goes to flower-supernode unchanged.",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_INTERVAL,
        help=f"longest idle wait in seconds (default {DEFAULT_POLL_INTERVAL})",
    )
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cap = check_poll_interval(args.poll_interval)
    except ValueError as err:
        parser.error(f"--poll-interval: {err}")
    os.environ.setdefault(SUPEREXEC_POLL_VAR, repr(cap))  # inherited by its SuperExec
    shorten_waits(cap)
    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *rest]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
