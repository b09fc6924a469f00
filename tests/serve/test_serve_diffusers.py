"""``omni-async serve --model diffusers:MODULE:BUILDER``: a diffusers pipeline behind the API,
its parameters published from the integration's schema and checked at the door."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from PIL import Image

from helpers.servers import ServerProcess

pytest.importorskip("diffusers")
MODEL = "diffusers:omni_async.integrations.diffusers.tiny:tiny_dit"


@pytest.mark.slow  # a diffusers pipeline's server start; tests/serve/test_serve_api.py covers the server
def test_a_diffusers_pipeline_served_with_its_own_parameters() -> None:
    server = ServerProcess("--model", MODEL, "--encode-workers", "1")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        (model,) = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert model["id"] == MODEL and {"class_labels", "num_inference_steps"} <= set(model["parameters"])
        result = client.images.generate(prompt="p", n=2, extra_body={"num_inference_steps": 2, "class_labels": 3})
        sizes = [Image.open(io.BytesIO(base64.b64decode(d.b64_json or ""))).size for d in result.data or []]
        assert sizes == [(16, 16), (16, 16)]  # tiny_dit's one size
        refusals: list[tuple[dict[str, object], str]] = [
            ({"size": "64x64"}, "size"),  # DiTPipeline takes no height or width
            ({"num_inference_steps": "two"}, "num_inference_steps"),
            ({"prompt_embeds": [1.0]}, "prompt_embeds"),  # not a parameter of DiTPipeline
        ]
        for fields, param in refusals:
            r = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "p", **fields})
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
        video = httpx.post(f"{server.url}/v1/videos", json={"prompt": "p"})
        assert (video.status_code, video.json()["error"]["param"]) == (400, "model"), video.text
        assert server.stop() == 0, server.output()
    finally:
        if server.proc.poll() is None:
            server.stop()
    assert not server.left_behind(), server.left_behind()


def test_cuda_graphs_reach_a_diffusers_models_spec_and_are_refused_elsewhere() -> None:
    """``--cuda-graphs``: the worker's ``cuda_graphs=True`` for a diffusers model on a CUDA
    device (checked without the device: the spec is data), refused at once for the others."""
    import subprocess
    import sys

    from omni_async.core.errors import UsageError
    from omni_async.serve import served_model

    model = served_model(MODEL, device="cuda", cuda_graphs=True)
    assert model.spec.kwargs["cuda_graphs"] is True
    assert served_model(MODEL, device="cpu").spec.kwargs["cuda_graphs"] is False
    with pytest.raises(UsageError, match="device='cpu' is not a CUDA device"):
        served_model(MODEL, device="cpu", cuda_graphs=True)
    with pytest.raises(UsageError, match="model 'tiny' is not a diffusers:MODULE:BUILDER model"):
        served_model("tiny", cuda_graphs=True)
    cli = [sys.executable, "-m", "omni_async.cli", "serve", "--model", "tiny", "--device", "cpu", "--cuda-graphs"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--cuda-graphs replays a diffusers pipeline's denoiser" in done.stderr
