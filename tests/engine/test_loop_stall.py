"""Issue 31: the engine's event loop never blocks on an encode, and its owned copies
reuse memory without ever changing a result the caller holds.

``LoopStallMonitor`` measures the loop's lag with a periodic callback.  With 16 PNG
requests in flight at once the loop's stalls (their 99th percentile, and the code the
loop ran in its longest) must stay well under what one encode of the same pixels costs
when run on the loop, measured in the same test on the same machine under the same load
(a ratio, not a fixed number: the CI machine is noisy).
An encode (or a blocking wait for one) on the loop stalls it for at least that long.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch

from helpers.engine_harness import assert_quiescent, run
from helpers.leaks import kept_for_the_module
from omni_async.cli.bench_loop import picture_pixels
from omni_async.core.config import Deadlines
from omni_async.core.encoding import Encoding
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionRequest
from omni_async.engine.encoders import EncodedOutput, encode_image
from omni_async.engine.engine import AsyncDiffusionEngine
from omni_async.engine.loop_stall import LoopStallMonitor, LoopStalls
from omni_async.engine.owned import POOLED_FROM_BYTES
from omni_async.executor.multiproc import MultiprocDiffusionExecutor, WorkerSpec

SPEC = WorkerSpec("omni_async.models.synthetic:SyntheticForwardWorker", {"device": "cpu"}, postprocess="bench-u8")
DEADLINES = Deadlines(compute_timeout=120, output_timeout=120, rpc_timeout=120)
SIDE = 512  # a PNG of it takes a core for 100-400 ms here: well above the loop's noise


@pytest.fixture(scope="module")
def ex() -> Iterator[MultiprocDiffusionExecutor]:
    yield from kept_for_the_module(MultiprocDiffusionExecutor(SPEC, deadlines=DEADLINES))


def test_the_monitor_sees_the_loop_blocked_how_long_and_whether_it_ran() -> None:
    async def body() -> None:
        async with LoopStallMonitor(period=0.001) as asleep:
            await asyncio.sleep(0.03)
            time.sleep(0.08)  # the loop's thread blocked, waiting (as on the GIL)
            await asyncio.sleep(0.03)
        seen = asleep.stalls()
        assert 75 <= seen.max_ms < 2000 and seen.max_cpu_ms < 40, seen
        assert seen.samples >= 10 and seen.p50_ms <= seen.p99_ms <= seen.max_ms and seen.period_ms == 1.0
        assert asleep.stop() == seen  # stopped: nothing more is measured
        with pytest.raises(UsageError, match="already started"):
            asleep.start()
        async with LoopStallMonitor(period=0.001) as busy:
            await asyncio.sleep(0.01)
            end = time.thread_time() + 0.1
            while time.thread_time() < end:  # the loop running code: an encode on it
                pass
            await asyncio.sleep(0.01)
        seen = busy.stalls()
        assert 95 <= seen.max_ms < 2000 and seen.max_cpu_ms >= 90, seen

    run(body())
    with pytest.raises(UsageError, match="period"):
        LoopStallMonitor(period=0)


def test_sixteen_png_encodes_never_stall_the_loop_for_a_fraction_of_one_encode(
    ex: MultiprocDiffusionExecutor,
) -> None:
    params = {"forward_ms": 0.0, "shape": [SIDE, SIDE, 3], "dtype": "float32", "picture": True}

    async def body() -> tuple[LoopStalls, float]:
        # One encoder process: two would take both cores of the CI machine, and the loop's
        # thread then waits for a core (stalls of 20-80 ms that no code of ours causes).
        async with AsyncDiffusionEngine(ex, encode_workers=1) as engine:
            await engine.generate(DiffusionRequest("warm", params, format="png"))  # starts the encoder processes
            # What one encode stalls this loop when run on it, here and now.
            pixels = picture_pixels(SIDE)
            on_loop = []
            for _ in range(2):
                t0 = time.perf_counter()
                encode_image(pixels, Encoding("png"))
                on_loop.append(time.perf_counter() - t0)
            async with LoopStallMonitor() as monitor:
                results = await asyncio.gather(
                    *(
                        engine.generate(DiffusionRequest(f"png{i}", {**params, "seed": i}, format="png"))
                        for i in range(16)
                    )
                )
            assert all(isinstance(r.output, EncodedOutput) and r.media_type == "image/png" for r in results)
            await assert_quiescent(engine)
        return monitor.stalls(), 1e3 * min(on_loop)

    stalls, encode_ms = run(body())
    assert encode_ms >= 20, f"one PNG encode took {encode_ms:.1f} ms: too fast for the ratio to tell anything"
    # An encode on the loop, or a wait for one, stalls it once per request: 16 stalls of an
    # encode each, most of the samples.  The loop never ran an encode's worth of code, and
    # its 99th percentile stays under half an encode.  Not its maximum: with both cores
    # busy (the other test worker, TLC's threads, the encoder), the loop's thread once
    # waited 104 ms for a core while running 0 ms of code (CI, one encode 127 ms).
    assert stalls.max_cpu_ms < 0.5 * encode_ms, f"the loop ran code for an encode's time: {stalls.line()}"
    assert stalls.p99_ms < 0.5 * encode_ms, f"one encode takes {encode_ms:.1f} ms; the loop: {stalls.line()}"
    assert stalls.samples >= 100, stalls.line()


def test_a_result_the_caller_holds_never_changes_while_its_memory_waits_for_reuse(
    ex: MultiprocDiffusionExecutor,
) -> None:
    """The owned copies go into the engine's ``HostBuffers``: a held result keeps its
    values however many requests of its size follow; once dropped its memory is reused."""
    shape = [POOLED_FROM_BYTES + 4096]  # uint8 after the device stage: a pooled copy

    async def body() -> None:
        async with AsyncDiffusionEngine(ex) as engine:
            buffers = engine._post.buffers

            async def one(seed: int) -> torch.Tensor:
                res = await engine.generate(
                    DiffusionRequest(f"r{seed}", {"shape": shape, "dtype": "float32", "seed": seed})
                )
                assert isinstance(res.output, dict)
                out = res.output["video"]
                assert isinstance(out, torch.Tensor) and out.dtype == torch.uint8
                return out

            held = await one(1)
            expected = held.clone()
            for seed in (2, 3, 4):
                other = await one(seed)
                assert not torch.equal(other, expected) and other.data_ptr() != held.data_ptr()
                del other
            assert torch.equal(held, expected)
            assert buffers.reused >= 2  # the dropped ones came back and were taken again
            ptr = held.data_ptr()
            del held
            again = await one(5)
            assert again.data_ptr() == ptr or buffers.reused >= 3
            await assert_quiescent(engine)

    run(body())
