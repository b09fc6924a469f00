"""``omni-async serve`` under pressure and at its end: a full queue (429), a dead worker
(503), SIGTERM with requests in flight (each ends, exit 0, nothing left in /dev/shm)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from helpers.servers import ServerProcess

SLOW = {"steps": 4, "step_ms": 150}  # about 0.6 s a forward, asleep: the machine stays free


def _image(url: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json={"prompt": "p", **SLOW}, timeout=timeout)


def _active(url: str) -> dict[str, float]:
    """The engine's requests now, by state (waiting, running, holding, postprocessing)."""
    text = httpx.get(f"{url}/metrics").text
    prefix = 'omni_async_engine_active_requests{state="'
    return {x[len(prefix) :].split('"')[0]: float(x.split()[-1]) for x in text.splitlines() if x.startswith(prefix)}


def _running(url: str) -> float:
    return _active(url).get("running", 0.0)


def test_full_queue_is_429_then_sigterm_lets_requests_in_flight_end() -> None:
    server = ServerProcess(
        "--model", "tiny", "--max-batch-size", "1", "--max-running", "1", "--max-waiting", "1", "--encode-workers", "1"
    )
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with ThreadPoolExecutor(4) as pool:
            # One runs, one waits; the others find the queue full.
            answers = [f.result() for f in [pool.submit(_image, server.url) for _ in range(4)]]
        codes = sorted(r.status_code for r in answers)
        assert codes.count(200) >= 2 and codes.count(429) >= 1, codes
        refused = next(r for r in answers if r.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "engine_overloaded"
        assert all(len(r.json()["data"]) == 1 for r in answers if r.status_code == 200)
        # The openai client sees a RateLimitError (its own retries honour Retry-After).
        with ThreadPoolExecutor(3) as pool:
            busy = [pool.submit(_image, server.url) for _ in range(2)]
            time.sleep(0.2)
            with pytest.raises(openai.RateLimitError):
                client.images.generate(prompt="p", extra_body=SLOW)
            [f.result() for f in busy]

        # SIGTERM with two requests in flight: both end with their images, then the server exits 0.
        with ThreadPoolExecutor(2) as pool:
            in_flight = [pool.submit(_image, server.url) for _ in range(2)]
            deadline = time.monotonic() + 10
            while _running(server.url) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            code = server.stop(signal.SIGTERM)
            answers = [f.result() for f in in_flight]
        assert code == 0, server.output()
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    finally:
        server.stop(signal.SIGKILL) if server.proc.poll() is None else None
    assert not server.left_behind(), server.left_behind()


def test_sigterm_to_the_whole_process_group_lets_requests_in_flight_end() -> None:
    """A service manager's stop (systemd's default ``KillMode=control-group``) sends SIGTERM to
    every process of the service at once.  The defect: the worker and encoder processes died
    of it ("worker rank 0 died with exit code -15"; "encoder ... died (killed by SIGTERM)"),
    so the requests the graceful stop waits for failed with 500.  They ignore it now, and
    leave when the engine closes."""
    server = ServerProcess("--model", "tiny", "--max-batch-size", "1", "--encode-workers", "1", own_group=True)
    try:
        _image(server.url)  # the encoder process is up (the first encode starts the pool)
        with ThreadPoolExecutor(2) as pool:
            in_flight = [pool.submit(_image, server.url) for _ in range(2)]
            # Both in the engine (one running, one waiting for it) before the stop: a request
            # still connecting when it comes would be refused, as a stopping server should.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                now = _active(server.url)
                if now.get("running", 0.0) >= 1 and sum(now.values()) >= 2:
                    break
                time.sleep(0.02)
            code = server.stop(signal.SIGTERM, group=True)
            answers = [f.result() for f in in_flight]
        assert code == 0, server.output()
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        assert all(len(r.json()["data"]) == 1 for r in answers)
        assert "died" not in server.output(), server.output()
    finally:
        server.stop(signal.SIGKILL) if server.proc.poll() is None else None
    assert not server.left_behind(), server.left_behind()


def _spawned_children(pid: int) -> list[int]:
    """The server's multiprocessing children that run a worker (not its resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def test_health_is_503_once_a_worker_dies_and_sigterm_still_exits_clean() -> None:
    server = ServerProcess("--model", "tiny", "--encode-workers", "1")
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        workers = _spawned_children(server.proc.pid)  # before any encode: only the model's worker
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{server.url}/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["error"]["code"] == "unhealthy", health.text
        image = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "p"})
        assert image.status_code == 503, image.text
        code = server.stop(signal.SIGTERM)
        assert code == 0, server.output()
    finally:
        server.stop(signal.SIGKILL) if server.proc.poll() is None else None
    assert not server.left_behind(), server.left_behind()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_dit_pipeline_on_cuda_serves_images_and_a_clip() -> None:
    server = ServerProcess("--model", "dit", "--device", "cuda")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        result = client.images.generate(prompt="p", n=2, size="256x256", extra_body={"steps": 4})
        assert result.data is not None and len(result.data) == 2
        r = httpx.post(f"{server.url}/v1/videos", json={"prompt": "p", "seconds": "1", "size": "128x128"})
        assert r.status_code == 200, r.text
        assert server.stop(signal.SIGTERM) == 0, server.output()
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)
    assert not server.left_behind(), server.left_behind()
