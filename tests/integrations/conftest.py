"""The diffusers pipelines called directly, which the tests here compare against (one of
each per test module: building them is the slow part)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.diffusers_direct import direct_pipeline


@pytest.fixture(scope="module")
def dit_direct() -> Any:
    return direct_pipeline("dit")


@pytest.fixture(scope="module")
def wan_direct() -> Any:
    return direct_pipeline("wan")
