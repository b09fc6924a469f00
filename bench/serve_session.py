"""A session with the ``openai`` client against ``omni-async serve --model tiny``: each call,
its answer and its time, then SIGTERM (the closing note of issue 32 shows it).

    PYTHONPATH=src python3 bench/serve_session.py > bench/results/serve_session_cpu.txt
"""

import base64
import io
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import openai
from PIL import Image

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the client marks its videos API so
env = dict(os.environ, PYTHONPATH=os.getcwd() + "/src")
cmd = [sys.executable, "-m", "omni_async.cli", "serve", "--model", "tiny", "--port", "0", "--poll-after-ms", "100"]
t0 = time.perf_counter()
server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
line = server.stdout.readline().strip()
url = re.search(r"http://\S+", line).group(0)
print(
    f"$ omni-async serve --model tiny --port 0 --poll-after-ms 100\n{line}   ({time.perf_counter() - t0:.1f} s to ready)\n"
)
c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def timed(label, fn):
    print(f">>> {label}")
    t = time.perf_counter()
    try:
        return fn()
    finally:
        print(f"    ({1000 * (time.perf_counter() - t):.0f} ms)")


timed(
    "client.images.generate(prompt='a cat', size='64x64')  # first request: the encoders start",
    lambda: c.images.generate(prompt="a cat", size="64x64"),
)
r = timed(
    "client.images.generate(model='tiny', prompt='a cat', n=2, size='64x48', output_format='jpeg', extra_body={'seed': 7})",
    lambda: c.images.generate(
        model="tiny", prompt="a cat", n=2, size="64x48", output_format="jpeg", extra_body={"seed": 7}
    ),
)
print(
    "   ",
    [(im.format, im.size) for im in (Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in r.data)],
    "output_format",
    r.output_format,
    "size",
    r.size,
)
ev = timed(
    "list(client.images.generate(prompt='a cat', stream=True, partial_images=2, extra_body={'steps': 6}))",
    lambda: list(c.images.generate(prompt="a cat", stream=True, partial_images=2, extra_body={"steps": 6})),
)
print("   ", [(e.type, getattr(e, "partial_image_index", None)) for e in ev])
u = timed(
    "client.images.generate(prompt='a cat', response_format='url')",
    lambda: c.images.generate(prompt="a cat", response_format="url"),
)
print("   ", u.data[0].url)
try:
    timed(
        "client.images.generate(prompt='a cat', extra_body={'steps': 0})",
        lambda: c.images.generate(prompt="a cat", extra_body={"steps": 0}),
    )
except openai.BadRequestError as e:
    print("    BadRequestError", e.status_code, e.body)
v = timed(
    "client.videos.create_and_poll(model='tiny', prompt='waves', seconds='4', size='64x64')",
    lambda: c.videos.create_and_poll(model="tiny", prompt="waves", seconds="4", size="64x64"),
)
print("   ", v.id, v.status, v.progress, v.seconds, v.size)
data = timed("client.videos.download_content(video.id).read()", lambda: c.videos.download_content(v.id).read())
print("   ", len(data), "bytes, starts", data[4:8])
print("   ", timed("client.videos.delete(video.id)", lambda: c.videos.delete(v.id)))
t = time.perf_counter()
server.send_signal(signal.SIGTERM)
code = server.wait(60)
print(f"\n$ kill -TERM <server>   -> exit {code} after {1000 * (time.perf_counter() - t):.0f} ms")
