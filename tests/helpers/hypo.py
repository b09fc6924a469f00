"""Hypothesis budgets for the two tiers (tests/conftest.py loads the profiles).

The full run's profiles keep Hypothesis' default of 100 examples a test; the fast
tier's (``pytest -m "not slow"``) set ``FAST_MAX_EXAMPLES``.  A test that sets its own
count passes it through ``examples`` so that it shrinks in the same proportion.
"""

from __future__ import annotations

from hypothesis import settings

FULL_MAX_EXAMPLES = 100
FAST_MAX_EXAMPLES = 20


def examples(n: int) -> int:
    """``n`` under the full run's profiles, proportionally fewer (at least 2) under the fast tier's.

    Read at import (module-level ``settings(...)``): the profile is loaded by then."""
    current = settings.default
    assert current is not None  # a profile is loaded from the start
    budget: int = current.max_examples
    return max(2, n * budget // FULL_MAX_EXAMPLES)
