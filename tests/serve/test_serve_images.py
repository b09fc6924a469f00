"""``ImageService`` over an engine in this process: a failed member of an ``n`` leaves no file."""

from __future__ import annotations

import asyncio

import pytest

from omni_async import AsyncDiffusionEngine, InProcessExecutor
from omni_async.models.tiny import TinyDiffusionWorker
from omni_async.serve.errors import ApiError
from omni_async.serve.images import ImageService
from omni_async.serve.parsing import ImageGeneration


def _gen(*params: dict[str, object]) -> ImageGeneration:
    return ImageGeneration(
        prompt="p",
        params=params,
        size="64x32",
        response_format="url",
        output_format="png",
        quality=None,
        stream=False,
        partial_images=0,
    )


def test_a_failed_member_of_a_url_request_leaves_no_file_of_its_siblings() -> None:
    async def main() -> None:
        executor = InProcessExecutor(
            lambda rank: TinyDiffusionWorker(),
            validate_request=TinyDiffusionWorker.validate_request,
            postprocess="tiny",
        )
        engine = AsyncDiffusionEngine(executor, encode_workers=1)
        try:
            async with engine:
                images = ImageService(engine)
                warm: dict[str, object] = {"height": 32, "seed": 0}
                await images.generate(_gen(warm), "warm", "http://x/v1/files")
                assert len(engine.files) == 1  # the warm-up's own file, kept until its ttl
                # The first member ends (its file written) while the second still runs, then fails.
                fast: dict[str, object] = {"height": 32, "seed": 1, "steps": 1}
                slow: dict[str, object] = {"height": 32, "seed": 2, "steps": 4, "step_ms": 100, "raise_at_step": 4}
                with pytest.raises(ApiError) as err:
                    await images.generate(_gen(fast, slow), "img_x", "http://x/v1/files")
                assert err.value.status == 500 and "img_x" in err.value.message
                assert engine.metrics().requests["finished"] == 2  # the warm-up and the fast member
                assert len(engine.files) == 1, "the finished member's file outlived its failed request"
        finally:
            executor.shutdown()

    asyncio.run(main())
