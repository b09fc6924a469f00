"""TLC for the tests: skip on a laptop without Java or tla2tools.jar, fail in CI.

Every TLC test calls ``require_tlc()`` first.  With ``CI`` set a missing tool is a
failure with the reason (CI must run every model); elsewhere the test is skipped
with the same reason.
"""

from __future__ import annotations

import os

import pytest

from omni_async.verify.tlc import Toolchain, find_toolchain, toolchain_problem


def require_tlc() -> Toolchain:
    problem = toolchain_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{problem} (CI is set: the TLC checks must run)", pytrace=False)
        pytest.skip(problem)
    return find_toolchain()
