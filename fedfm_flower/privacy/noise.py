"""DP noise that no party can regenerate: Gaussian draws keyed, per release, by OS entropy.

Each release (central: one round's noised average; local: one client's noised update in one
round) draws from its own NumPy ``Philox`` generator whose 128-bit key comes from the operating
system's CSPRNG (``secrets.randbits``). The key is never stored, logged, checkpointed or sent,
and nothing else draws from the generator, so whoever knows the run config, the run seed and
the code (every ClientApp and the server do) cannot reproduce the noise: recovering it means
guessing 128 bits.

Choices, and why:

* **Not the run seed.** The seed reaches every ClientApp in its run config; noise derived from
  it would let the server subtract it and recover the un-noised average (central) or every
  client's clipped update (local). The run seed keeps driving data, sampling and training, so a
  run without DP stays reproducible; a DP run is reproducible except for its noise.
* **Not ``torch.Generator``.** Its CPU generator (mt19937) keeps only the low 32 bits of a seed
  (``manual_seed(s)`` and ``manual_seed(s + 2**32)`` draw the same numbers), so a key drawn
  from OS entropy would still leave 2**32 candidates, few enough to try one by one against a
  noised update whose residual must have norm <= C.
* **A keyed counter-based generator, not raw OS bytes.** Philox4x64-10 turns the 128-bit key
  into the stream NumPy's Ziggurat sampler reads (about 17 ms per million float64 normals here);
  the OS's own CSPRNG seeds it. The floating-point artefacts of sampling Gaussians on a
  computer (Mironov 2012, for Laplace) are not addressed, as in Opacus and Flower.

``fresh_gaussian`` is looked up at call time by ``mechanism.add_gaussian_noise``, so a test can
wrap it to see the noise a run drew.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

import numpy as np
import torch

NOISE_SOURCE = "os-entropy"  # what checkpoints, ledgers and summaries record
KEY_BITS = 128


def fresh_generator() -> np.random.Generator:
    """A generator no one can reproduce: Philox keyed by 128 bits of OS entropy."""
    return np.random.Generator(np.random.Philox(key=secrets.randbits(KEY_BITS)))


def fresh_gaussian(shapes: Mapping[str, tuple[int, ...]], std: float) -> dict[str, torch.Tensor]:
    """Independent N(0, std^2) float64 draws of each shape (one fresh generator for the whole
    release, names in sorted order)."""
    generator = fresh_generator()
    return {
        name: torch.from_numpy(np.asarray(generator.standard_normal(tuple(shapes[name])) * std))
        for name in sorted(shapes)
    }
