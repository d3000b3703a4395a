"""Torch's CPU thread count pinned for a block, so that what it computes does not depend on it.

On the CPU the thread count changes how a matrix product splits its sums, hence the last bits of
the result; over a pretraining of thousands of steps those bits grow into other weights (the
small-vit on glyph-domains after 3 epochs: weights up to 0.025 apart, public test accuracy 14.4%
at 1 thread against 11.1% at 2). The cached foundations are keyed by what changes them, and the
process that builds one may be a serial sweep on every core, a Ray cell with one CPU or a
SuperNode: pretraining therefore runs at ``PRETRAIN_THREADS`` threads whatever the caller's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

PRETRAIN_THREADS = 1  # the only count every machine has


@contextmanager
def pinned_threads(threads: int = PRETRAIN_THREADS) -> Iterator[None]:
    """Run the block (or, as a decorator, the function) at ``threads`` torch threads; the
    caller's count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
