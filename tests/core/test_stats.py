"""Per-output stats are a typed record that also reads as the mapping it replaced."""

from __future__ import annotations

import pickle

import attrs
import pytest

from omni_async.core.messages import DiffusionOutput
from omni_async.core.stats import OutputStats, as_stats


def test_a_mapping_is_converted_known_keys_to_fields_the_rest_to_extra() -> None:
    out = DiffusionOutput("r", metrics={"pack_s": 0.25, "my_model_steps": 4.0})
    assert isinstance(out.metrics, OutputStats)
    assert out.metrics.pack_s == 0.25 and out.metrics.pack_shm_bytes is None
    assert out.metrics.extra == {"my_model_steps": 4.0}
    assert dict(out.metrics) == {"pack_s": 0.25, "my_model_steps": 4.0}
    assert out.metrics["pack_s"] == 0.25 and out.metrics.get("pack_shm_bytes", 0.0) == 0.0
    assert "pack_shm_bytes" not in out.metrics and len(out.metrics) == 2
    with pytest.raises(KeyError):
        out.metrics["pack_shm_bytes"]
    assert pickle.loads(pickle.dumps(out)) == out


def test_producers_set_typed_fields() -> None:
    stats = attrs.evolve(OutputStats(), pack_s=1.0, pack_shm_bytes=8.0)
    assert dict(stats.set(forward_started_at=2.0, custom=3.0)) == {
        "pack_s": 1.0,
        "pack_shm_bytes": 8.0,
        "forward_started_at": 2.0,
        "custom": 3.0,
    }
    assert as_stats(stats) is stats and as_stats(None) == OutputStats()
    with pytest.raises(ValueError, match="pack_s"):
        OutputStats(extra={"pack_s": 1.0})
