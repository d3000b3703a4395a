"""The Hypothesis settings of the property-based tests (``tests/test_properties_*.py``).

CI runs the profile ``ci``: derandomized (the same examples on every run and machine), no
example database, no deadline (the 2-core CI machine is shared; a slow example is not a
failure). ``FEDFM_HYPOTHESIS_PROFILE=explore`` draws fresh random examples instead, and
``FEDFM_PROPERTY_SCALE`` multiplies every test's example count, for a deeper search by hand::

    FEDFM_HYPOTHESIS_PROFILE=explore FEDFM_PROPERTY_SCALE=10 \\
        python -m pytest -q tests/test_properties_replies.py --hypothesis-show-statistics

The example counts of CI (the sum is stated in README.md's "Property-based tests") are the
``examples(...)`` arguments of the tests at scale 1.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile(
    "ci", deadline=None, derandomize=True, database=None, print_blob=True, max_examples=100
)
settings.register_profile("explore", parent=settings.get_profile("ci"), derandomize=False)
settings.load_profile(os.environ.get("FEDFM_HYPOTHESIS_PROFILE", "ci"))

SCALE = float(os.environ.get("FEDFM_PROPERTY_SCALE", "1"))


def examples(count: int) -> int:
    """``count`` examples, times ``FEDFM_PROPERTY_SCALE`` (at least one)."""
    return max(1, round(count * SCALE))
