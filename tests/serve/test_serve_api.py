"""``omni-async serve --model tiny`` driven by the real ``openai`` client (no mocks).

One server for the module (a subprocess of the real command, on a free loopback port);
after the module it is stopped with SIGTERM, and must exit 0 leaving nothing in /dev/shm.
"""

from __future__ import annotations

import base64
import io
import re
import time
from collections.abc import Iterator

import av
import httpx
import openai
import pytest
from PIL import Image

from helpers.servers import ServerProcess, started_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks its videos API so


URL_TTL_S = 2


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from started_server(
        "--model", "tiny", "--poll-after-ms", "50", "--encode-workers", "1", "--output-ttl-s", str(URL_TTL_S)
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def engine_counts(server: ServerProcess) -> dict[str, float]:
    """The engine's request outcomes and queue depths, from /metrics."""
    text = httpx.get(f"{server.url}/metrics").text
    counts = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^omni_async_engine_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)
    }
    for m in re.finditer(r'^omni_async_engine_active_requests\{state="(\w+)"\} (\S+)$', text, re.M):
        counts[f"active_{m.group(1)}"] = float(m.group(2))
    for name in ("batched", "batches"):
        found = re.search(rf"^omni_async_engine_{name}_total (\S+)$", text, re.M)
        counts[name] = float(found.group(1)) if found else 0.0
    return counts


def settled(server: ServerProcess, timeout: float = 10.0) -> dict[str, float]:
    """The counts once nothing is waiting, running or held in the engine."""
    deadline = time.monotonic() + timeout
    while True:
        counts = engine_counts(server)
        busy = sum(v for k, v in counts.items() if k.startswith("active_"))
        if not busy or time.monotonic() > deadline:
            assert not busy, counts
            return counts
        time.sleep(0.05)


def test_models_health_and_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    httpx.get(f"{server.url}/v1/models")
    text = httpx.get(f"{server.url}/metrics").text
    assert 'omni_async_http_requests_total{method="GET",route="/v1/models",status="200"}' in text
    assert "omni_async_http_request_seconds_bucket" in text
    assert "omni_async_engine_loop_up 1.0" in text


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_images_n2_in_each_format_as_one_batch(server: ServerProcess, client: openai.OpenAI, fmt: str) -> None:
    before = settled(server)
    result = client.images.generate(
        prompt="a grey square",
        model="tiny",
        n=2,
        size="64x48",
        output_format=fmt,  # type: ignore[call-overload]
    )
    assert result.data is not None and len(result.data) == 2
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json or ""))) for d in result.data]
    assert [(im.format, im.size) for im in images] == [({"jpeg": "JPEG"}.get(fmt, fmt.upper()), (64, 48))] * 2
    assert images[0].tobytes() != images[1].tobytes()  # seeds seed, seed + 1
    after = settled(server)
    assert after["finished"] - before["finished"] == 2
    assert after["batched"] - before["batched"] == 1  # the two images were one batched forward


def test_seed_makes_the_same_image(client: openai.OpenAI) -> None:
    one, two = (client.images.generate(prompt="p", extra_body={"seed": 7}) for _ in range(2))
    assert one.data and two.data and one.data[0].b64_json == two.data[0].b64_json


def test_streamed_partial_images(client: openai.OpenAI) -> None:
    events = list(client.images.generate(prompt="p", stream=True, partial_images=2, extra_body={"steps": 6}))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [getattr(e, "partial_image_index", None) for e in events] == [0, 1, None]
    for e in events:
        assert Image.open(io.BytesIO(base64.b64decode(e.b64_json))).size == (64, 64)


def test_video_job_create_poll_download_delete(server: ServerProcess, client: openai.OpenAI) -> None:
    video = client.videos.create(prompt="waves", model="tiny", seconds="4", size="64x32")  # type: ignore[arg-type]
    assert video.status in ("queued", "in_progress") and video.object == "video"
    done = client.videos.poll(video.id)  # paced by openai-poll-after-ms
    assert (done.status, done.progress, done.error) == ("completed", 100, None)
    data = client.videos.download_content(video.id).read()
    with av.open(io.BytesIO(data), mode="r") as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 16 and (frames[0].width, frames[0].height) == (64, 32)  # 4 s at 4 fps
    deleted = client.videos.delete(video.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (video.id, True, "video.deleted")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    poll = httpx.get(f"{server.url}/v1/videos/{video.id}")
    assert poll.status_code == 404 and poll.json()["error"]["param"] == "id"


def test_video_deleted_mid_flight_is_aborted(server: ServerProcess, client: openai.OpenAI) -> None:
    before = settled(server)
    video = client.videos.create(prompt="slow", seconds="4", extra_body={"steps": 50, "step_ms": 100})
    deadline = time.monotonic() + 10
    while client.videos.retrieve(video.id).status != "in_progress" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.videos.retrieve(video.id).status == "in_progress"
    assert client.videos.delete(video.id).deleted
    after = settled(server, timeout=2.0)  # delete returned after the abort completed
    assert after["aborted"] - before["aborted"] == 1
    assert after["finished"] == before["finished"]


def test_video_content_streams_before_the_job_is_completed(server: ServerProcess, client: openai.OpenAI) -> None:
    video = client.videos.create(prompt="slow", seconds="4", size="64x32", extra_body={"steps": 8, "step_ms": 100})  # type: ignore[arg-type]
    # Asked for at once: the answer starts while the job runs (it no longer waits, or says 409),
    # and its body is the MP4, whole, as the encoder made it.
    with httpx.stream("GET", f"{server.url}/v1/videos/{video.id}/content", timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
        assert r.headers["content-disposition"] == f'attachment; filename="{video.id}.mp4"'
        while_streaming = client.videos.retrieve(video.id).status
        streamed = b"".join(r.iter_bytes())
    assert while_streaming in ("queued", "in_progress")
    with av.open(io.BytesIO(streamed), mode="r") as container:
        assert len(list(container.decode(video=0))) == 16
    done = client.videos.poll(video.id)
    assert (done.status, done.progress) == ("completed", 100)
    # Once completed, the content comes from the file sink: the same bytes.
    assert client.videos.download_content(video.id).read() == streamed
    assert client.videos.delete(video.id).deleted


def test_a_stream_of_a_deleted_video_breaks_off(server: ServerProcess, client: openai.OpenAI) -> None:
    before = settled(server)
    video = client.videos.create(prompt="slow", seconds="4", extra_body={"steps": 50, "step_ms": 100})
    with httpx.stream("GET", f"{server.url}/v1/videos/{video.id}/content", timeout=30) as r:
        assert r.status_code == 200
        assert client.videos.delete(video.id).deleted
        # Short of its end, never a clean end that would pass for a whole file.
        with pytest.raises(httpx.RemoteProtocolError):
            b"".join(r.iter_bytes())
    after = settled(server, timeout=2.0)
    assert after["aborted"] - before["aborted"] == 1 and after["finished"] == before["finished"]
    # The server says so once, in a line, with no traceback (neither its own nor uvicorn's).
    deadline = time.monotonic() + 5
    while f"video {video.id}: its content's stream broke off: its job was deleted" not in server.output():
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.05)
    told = [line for line in server.output().splitlines() if video.id in line]
    assert len(told) == 1, told
    assert "Traceback" not in server.output()


def test_video_job_as_json(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/videos", json={"prompt": "x", "seconds": "1", "size": "64x64"})
    assert r.status_code == 200, r.text
    assert r.headers["openai-poll-after-ms"] == "50"
    assert httpx.delete(f"{server.url}/v1/videos/{r.json()['id']}").json()["deleted"] is True


BAD_IMAGES: list[tuple[dict[str, object], str]] = [
    ({"model": "dall-e-3"}, "model"),
    ({"prompt": ""}, "prompt"),
    ({"n": 0}, "n"),
    ({"n": 11}, "n"),
    ({"n": "2"}, "n"),
    ({"size": "32x32"}, "size"),
    ({"size": "big"}, "size"),
    ({"size": "64x63"}, "size"),
    ({"response_format": "bytes"}, "response_format"),
    ({"output_format": "gif"}, "output_format"),
    ({"output_compression": 101}, "output_compression"),
    ({"seed": -1}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stream": True, "partial_images": 4}, "partial_images"),
    ({"stream": True, "n": 2}, "n"),
    ({"background": "transparent"}, "background"),
    ({"height": 32}, "height"),
    ({"preview_every": 1}, "preview_every"),
    ({"steps": 0}, "steps"),
    ({"colour": "red"}, "colour"),
]
BAD_VIDEOS: list[tuple[dict[str, object], str]] = [
    ({"model": "sora-2"}, "model"),
    ({"prompt": None}, "prompt"),
    ({"seconds": "0"}, "seconds"),
    ({"seconds": "13"}, "seconds"),
    ({"size": "720x1280"}, "size"),
    ({"num_frames": 3}, "num_frames"),
    ({"steps": "many"}, "steps"),
]


def test_bad_input_is_a_400_naming_the_field_and_reaches_no_worker(server: ServerProcess) -> None:
    before = settled(server)
    for fields, param in BAD_IMAGES:
        r = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "p", **fields})
        assert r.status_code == 400, (fields, r.text)
        assert r.json()["error"]["param"] == param, (fields, r.json())
        assert r.json()["error"]["type"] == "invalid_request_error"
    for fields, param in BAD_VIDEOS:
        r = httpx.post(f"{server.url}/v1/videos", json={"prompt": "p", **fields})
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), (fields, r.text)
    form = httpx.post(f"{server.url}/v1/videos", data={"prompt": "p", "seconds": "99"})
    assert (form.status_code, form.json()["error"]["param"]) == (400, "seconds")
    not_json = httpx.post(
        f"{server.url}/v1/images/generations", content=b"{", headers={"content-type": "application/json"}
    )
    assert not_json.status_code == 400
    after = settled(server)
    # The model's own parameters were refused by its validate_request at the engine's door
    # (counted "rejected"); not one request was admitted (a batch of one or more), none
    # reached a worker.
    model_refusals = 3  # steps=0, colour, steps="many"
    assert after == {**before, "rejected": before["rejected"] + model_refusals}


def test_url_images_come_from_the_file_sink_until_their_ttl(server: ServerProcess, client: openai.OpenAI) -> None:
    result = client.images.generate(prompt="p", n=2, size="64x40", response_format="url", output_format="webp")
    urls = [d.url for d in result.data or []]
    assert len(urls) == 2 and all(u and u.startswith(f"{server.url}/v1/files/") for u in urls), urls
    for url in urls:
        got = httpx.get(str(url))
        assert got.headers["content-type"] == "image/webp"
        assert Image.open(io.BytesIO(got.content)).size == (64, 40)
    time.sleep(URL_TTL_S + 0.2)
    gone = httpx.get(str(urls[0]))
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "file_id", gone.text
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="p", response_format="url", stream=True)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "response_format"


def test_unknown_video_and_route_are_404_in_openai_shape(server: ServerProcess) -> None:
    for path in ("/v1/videos/video_nope", "/v1/videos/video_nope/content", "/v1/nothing"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_model_failure_is_a_500_with_the_request_id(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as err:
        client.images.generate(prompt="p", extra_body={"raise": True})
    assert re.search(r"request img_[0-9a-f]{32}", str(err.value)), err.value


def test_client_that_disconnects_aborts_its_request(server: ServerProcess) -> None:
    before = settled(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/images/generations",
            json={"prompt": "p", "steps": 100, "step_ms": 50},
            timeout=httpx.Timeout(30, read=0.5),
        )
    after = settled(server)  # within 10 s: not the 5 s the forward would have taken
    assert after["cancelled"] - before["cancelled"] == 1
    assert after["finished"] == before["finished"]


def test_streaming_client_that_leaves_aborts_its_request(server: ServerProcess, client: openai.OpenAI) -> None:
    before = settled(server)
    stream = client.images.generate(prompt="p", stream=True, partial_images=3, extra_body={"steps": 100, "step_ms": 50})
    first = next(iter(stream))
    assert first.type == "image_generation.partial_image"
    stream.close()
    after = settled(server)
    assert after["finished"] == before["finished"]
    assert after["cancelled"] + after["aborted"] - before["cancelled"] - before["aborted"] == 1
