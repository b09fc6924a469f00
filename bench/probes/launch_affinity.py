"""Probe (CUDA only): does a launch-bound forward's speed depend on the CPUs its process runs on?

Issue 30's PixArt-Sigma-shaped forward (28 layers, 512x512, 20 steps, bf16) is bound by the
host's kernel launches, and through the engine (in a worker process) it ran 0.51-0.72 s a
forward against 0.51-0.52 s in the bench's own process, from run to run.  One cause that
fits: the CPU the launching thread runs on (its NUMA node against the GPU's, its clock).
Another: a thread of the same process spin-waiting on a CUDA event beside the launching one
(a worker's finisher waits on its copy's event).  This prints the machine's NUMA layout and
the GPU's local CPUs, then times the same forward in fresh processes pinned (``taskset``) to
the GPU's local CPUs and to the others, unpinned, and unpinned with a thread spin-waiting
on CUDA events (``spin_on_events``), in alternating order: a median forward per run (CUDA
events).

    python3 bench/probes/launch_affinity.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus() -> tuple[str, list[int]]:
    """GPU 0's PCI address (from nvidia-smi) and its local CPUs (from sysfs; [] if unknown)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "", []
    bus = out.lower()[-12:] if out else ""  # "00000000:19:00.0" -> "0000:19:00.0"
    try:
        with open(f"/sys/bus/pci/devices/{bus}/local_cpulist") as fh:
            return bus, cpulist(fh.read())
    except OSError:
        return bus, []


def spin_on_events(stop: threading.Event, blocking: bool = False) -> None:
    """What a worker's finisher thread does beside the forward: wait on a CUDA event (with
    CUDA's default schedule, a spin on a core when the process has fewer contexts than
    cores), here over and over on a short kernel of a side stream.  ``blocking``: the
    event made with ``cudaEventBlockingSync``, whose wait sleeps instead of spinning (the
    fix, if the spin is the cause)."""
    import torch

    side = torch.cuda.Stream()
    while not stop.is_set():
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000)  # about 0.1 ms of one SM
        done = torch.cuda.Event(blocking=blocking)
        done.record(side)
        done.synchronize()


def child(requests: int, preset: str, spinner: bool, blocking: bool = False) -> None:
    """One process: the PixArt pipeline of ``preset`` (h200: CUDA; tiny: a CPU smoke run),
    2 warm-up calls, then ``requests`` timed; ``spinner``: with ``spin_on_events`` beside them."""
    sys.path.insert(0, os.path.dirname(HERE))
    import diffusers_serving as ds  # bench/diffusers_serving.py

    work = ds.PRESETS[preset]["workloads"]["pixart"]
    loop = ds.DirectLoop("pixart", work, ds.PRESETS[preset]["device"])
    stop = threading.Event()
    if spinner:
        threading.Thread(target=spin_on_events, args=(stop, blocking), daemon=True).start()
    times = []
    for r in ds.requests("pixart", work, requests, "p"):
        t0 = time.perf_counter()
        _, device_s = loop.call(r)
        times.append((time.perf_counter() - t0, device_s))
    stop.set()
    print(json.dumps({"host_s": [t for t, _ in times], "device_s": [d if d is not None else t for t, d in times]}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--preset", default="h200", help="h200 (CUDA), or tiny: a smoke run on the CPU")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spinner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--blocking", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.requests, args.preset, args.spinner, args.blocking)
        return 0
    allowed = sorted(os.sched_getaffinity(0))
    bus, local = gpu_local_cpus()
    local = [c for c in local if c in allowed]
    remote = [c for c in allowed if c not in local]
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    except OSError:
        topo = "(no nvidia-smi)"
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(topo)
    print("\n".join(line for line in lscpu.splitlines() if "NUMA" in line or "MHz" in line or "Model name" in line))
    print(f"GPU {bus}: local CPUs {local or 'unknown'}; others allowed here {remote}")
    sets = {"unpinned": allowed}
    if args.preset == "h200":
        sets["unpinned+spinner"] = allowed  # a thread spin-waiting on CUDA events beside the forward
        sets["unpinned+sleeper"] = allowed  # the same waits on blocking-sync events: sleeping, not spinning
    if local:
        sets["gpu-local"] = local
    if remote:
        sets["remote"] = remote
    runs: list[dict[str, object]] = []

    def write(done: list[dict[str, object]]) -> None:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"command": " ".join(sys.argv), "gpu": bus, "local": local, "remote": remote,
                           "topo": topo, "lscpu": lscpu, "runs": done}, fh, indent=2)  # fmt: skip

    for r in range(args.rounds):
        order = list(sets) if r % 2 == 0 else list(reversed(list(sets)))
        for name in order:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                "--requests",
                str(args.requests),
                "--preset",
                args.preset,
            ]
            if name.endswith(("+spinner", "+sleeper")):
                cmd.append("--spinner")
            if name.endswith("+sleeper"):
                cmd.append("--blocking")
            cmd = ["taskset", "-c", ",".join(map(str, sets[name])), *cmd]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("{")), None)
            if line is None:
                print(f"{name}: failed\n{out.stderr[-2000:]}")
                continue
            got = json.loads(line)
            row = {
                "cpus": name,
                "round": r,
                "forward_s_median": statistics.median(got["device_s"]),
                "call_s_median": statistics.median(got["host_s"]),
                **got,
            }
            runs.append(row)
            write(runs)  # after every run: a probe cut short by its time limit keeps them
            print(
                f"round {r} {name:16} forward median {row['forward_s_median']:.4f} s  call {row['call_s_median']:.4f} s"
            )
    write(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
