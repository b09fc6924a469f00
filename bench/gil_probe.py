"""Does waiting on a CUDA stream/event release the GIL? (probe for the packer design)

Thread B launches a long matmul chain then waits on it in several ways; thread A counts
Python loop iterations meanwhile.  If A's count barely moves during B's wait, the wait
held the GIL.
"""

import threading
import time

import torch

dev = torch.device("cuda", 0)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def work():
    x = a
    for _ in range(40):
        x = x @ a
    return x


def count_during(wait_fn):
    stop = threading.Event()
    n = [0]

    def spin():
        while not stop.is_set():
            n[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.05)
    base = n[0]
    t0 = time.perf_counter()
    time.sleep(0.05)
    free_rate = (n[0] - base) / (time.perf_counter() - t0)
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        work()
    ev = torch.cuda.Event()
    ev.record(s)
    base = n[0]
    t0 = time.perf_counter()
    wait_fn(s, ev)
    dt = time.perf_counter() - t0
    rate = (n[0] - base) / dt
    stop.set()
    t.join()
    return dt, rate / free_rate


torch.cuda.synchronize()
for name, fn in [
    ("stream.synchronize", lambda s, ev: s.synchronize()),
    ("event.synchronize", lambda s, ev: ev.synchronize()),
    ("torch.cuda.synchronize", lambda s, ev: torch.cuda.synchronize(dev)),
    ("poll event.query + sleep", lambda s, ev: [time.sleep(0.0005) for _ in iter(lambda: ev.query(), True)]),
]:
    for _ in range(2):
        dt, ratio = count_during(fn)
    print(f"{name:28s} wait {dt * 1e3:7.1f} ms; other thread ran at {ratio:6.1%} of its free speed")
