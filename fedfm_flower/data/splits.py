"""Seeded, stratified splits: the public hold-out, the pretraining split, client train/test/val.

All splits stratify by label with exact sizes: each class gets its floor share and the few
samples left over go to the classes with the largest remainders (ties broken by the seeded
generator), so a split has ``round(fraction * n)`` samples and label proportions as close to
the whole as integers allow. Each split draws from its own random stream,
``numpy.random.default_rng([seed, stream, ...])``: the public split from (seed, PUBLIC), the
pretraining split from (seed, PRETRAIN), client ``p``'s split from (seed, CLIENT, p). So one
client's split never depends on another's, and changing the seed changes all of them.
"""

from __future__ import annotations

import numpy as np

PUBLIC_STREAM = 1
PRIVATE_ORDER_STREAM = 2
PRETRAIN_STREAM = 3
CLIENT_STREAM = 4
DOMAIN_STREAM = 5  # domain-dirichlet partitions: one Dirichlet stream per (seed, domain)
CLASS_DRAW_STREAM = 6  # disjoint partitions: which classes each client holds
PRETRAIN_TEST_FRACTION = 0.2


def entropy(seed: int) -> int:
    """``seed`` as the non-negative integer numpy's and flwr-datasets' generators require."""
    return seed % (1 << 63)


def rng_for(seed: int, *stream: int) -> np.random.Generator:
    """An independent generator for one named stream of one seed."""
    return np.random.default_rng([entropy(seed), *stream])


def stratified_take(labels: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted positions of ``count`` samples chosen stratified by ``labels``."""
    n = len(labels)
    if not 0 <= count <= n:
        raise ValueError(f"cannot take {count} of {n} samples")
    if count == 0:
        return np.empty(0, dtype=np.int64)
    classes, inverse = np.unique(labels, return_inverse=True)
    sizes = np.bincount(inverse, minlength=len(classes))
    share = sizes * count  # exact integer arithmetic: quota = share / n
    quota = share // n
    leftover = count - int(quota.sum())
    order = np.lexsort((rng.random(len(classes)), -(share % n)))
    quota[order[:leftover]] += 1
    chosen = [rng.permutation(np.flatnonzero(inverse == c))[:k] for c, k in enumerate(quota) if k]
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def complement(n: int, taken: np.ndarray) -> np.ndarray:
    """Sorted positions in ``range(n)`` not in ``taken``."""
    mask = np.ones(n, dtype=bool)
    mask[taken] = False
    return np.flatnonzero(mask)


def public_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(public, private) positions: a stratified ``fraction`` held out before partitioning."""
    count = int(round(fraction * len(labels)))
    public = stratified_take(labels, count, rng_for(seed, PUBLIC_STREAM))
    return public, complement(len(labels), public)


def pretrain_split(labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) positions of the public split for pretraining, 80/20 stratified."""
    count = int(round(PRETRAIN_TEST_FRACTION * len(labels)))
    test = stratified_take(labels, count, rng_for(seed, PRETRAIN_STREAM))
    return complement(len(labels), test), test


def client_split(
    labels: np.ndarray, test_fraction: float, val_fraction: float, seed: int, partition_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, test, val) positions within one client's partition; disjoint and covering.

    Sizes are ``round(fraction * n)`` of the whole partition; a partition of two or more
    samples keeps at least one test and one training sample.
    """
    n = len(labels)
    rng = rng_for(seed, CLIENT_STREAM, partition_id)
    n_test = int(round(test_fraction * n))
    if n >= 2:
        n_test = min(max(n_test, 1), n - 1)
    test = stratified_take(labels, n_test, rng)
    rest = complement(n, test)
    n_val = min(int(round(val_fraction * n)), max(len(rest) - 1, 0))
    val = rest[stratified_take(labels[rest], n_val, rng)]
    train = complement(n, np.concatenate([test, val]))
    return train, test, np.sort(val)
