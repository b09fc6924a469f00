"""What the view-lifetime rule (issue 8) costs per output: unpack + release, today vs. before.

Per output, on CPU, for a few sizes and leaf counts, the time of a zero-copy
``unpack_diffusion_output_shm`` plus giving the segment back, three ways:

* ``before``: the code as of commit 670d0fa (vendored below, unchanged in what it does):
  views straight into the segment, ``release_unpacked_output`` releases at once (and a
  view kept past it would show the next request's bytes);
* ``release``: today's unpack, then ``release_unpacked_output`` (takes the output's views
  back, checks that none is left, releases);
* ``drop``: today's unpack, then ``del`` of the output: its last view goes and the
  finalizer releases the segment before ``del`` returns.

The output's bytes are written once; each sample only leases the segment again (untimed)
and times unpack + release/drop, so what is measured is the bookkeeping, not a copy.
Variants are interleaved (rotating order, many rounds); the table gives medians and the
ratio to ``before``.

Usage: ``PYTHONPATH=src python bench/unpack_release.py [--rounds N] [--per-round N] [--out PATH]``
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import threading
import time
import weakref
from typing import Any

import attrs
import numpy as np
import torch

from omni_async.core.messages import DiffusionOutput
from omni_async.transport.packing import (
    InlineTensor,
    PackedMap,
    PackedObject,
    PackedPayload,
    PackedSeq,
    ShmArray,
    ShmBytes,
    ShmTensor,
    release_unpacked_output,
    unpack_diffusion_output_shm,
)
from omni_async.transport.shm import Lease, SegmentPool, attach_view

# -- the code as of 670d0fa: unpack_diffusion_output_shm(copy=False) and
#    release_unpacked_output, as they were (only renamed) -------------------------------


def _old_unwalk(x: Any, seg: torch.Tensor | None, copy: bool) -> Any:
    if isinstance(x, ShmTensor):
        assert seg is not None
        v = seg[x.offset : x.offset + x.nbytes]
        t = v.view(x.dtype).view(x.shape) if x.nbytes else torch.empty(x.shape, dtype=x.dtype)
        return t.clone() if copy else t
    if isinstance(x, InlineTensor):
        if not x.data:
            return torch.empty(x.shape, dtype=x.dtype)
        return torch.frombuffer(bytearray(x.data), dtype=torch.uint8).view(x.dtype).view(x.shape)
    if isinstance(x, ShmArray):
        assert seg is not None
        a = seg[x.offset : x.offset + x.nbytes].numpy().view(x.dtype).reshape(x.shape)
        return a.copy() if copy else a
    if isinstance(x, ShmBytes):
        assert seg is not None
        raw = seg[x.offset : x.offset + x.nbytes].numpy().tobytes()
        return bytearray(raw) if x.mutable else raw
    if isinstance(x, PackedSeq):
        items = [_old_unwalk(v, seg, copy) for v in x.items]
        if x.cls is list:
            return items
        if x.cls is tuple:
            return tuple(items)
        return x.cls(*items)
    if isinstance(x, PackedMap):
        pairs = [(k, _old_unwalk(v, seg, copy)) for k, v in x.items]
        if x.cls is collections.defaultdict:
            return collections.defaultdict(x.default_factory, pairs)
        return x.cls(pairs)
    if isinstance(x, PackedObject):
        obj: Any = object.__new__(x.cls)
        for name, v in x.fields:
            object.__setattr__(obj, name, _old_unwalk(v, seg, copy))
        return obj
    return x


_OLD_LOCK = threading.Lock()
_OLD_UNPACKED: dict[int, tuple[weakref.ref[DiffusionOutput], Lease]] = {}


def _old_forget(key: int) -> None:
    with _OLD_LOCK:
        _OLD_UNPACKED.pop(key, None)


def old_unpack(packed: DiffusionOutput) -> DiffusionOutput:
    payload = packed.output
    assert isinstance(payload, PackedPayload) and payload.lease is not None
    seg = attach_view(payload.lease.name, payload.lease.size)
    out = attrs.evolve(packed, output=_old_unwalk(payload.tree, seg, False))
    key = id(out)
    with _OLD_LOCK:
        _OLD_UNPACKED[key] = (weakref.ref(out), payload.lease)
    weakref.finalize(out, _old_forget, key)
    return out


def old_release(output: DiffusionOutput) -> int:
    with _OLD_LOCK:
        entry = _OLD_UNPACKED.get(id(output))
    if entry is None or entry[0]() is not output:
        return 0
    lease = entry[1]
    SegmentPool.for_prefix(lease.prefix).release(lease)
    return 1


# -- the measurement -----------------------------------------------------------------------


def make_tree(total: int, leaves: int) -> tuple[Any, int]:
    """A dict of ``leaves`` float32 tensors sharing ``total`` bytes, at 512-byte offsets."""
    each = total // leaves // 4 * 4
    items: list[tuple[str, object]] = []
    off = 0
    for i in range(leaves):
        items.append((f"t{i}", ShmTensor(off, each, torch.float32, (each // 4,))))
        off += -(-each // 512) * 512
    items.append(("note", "x"))
    return PackedMap(dict, tuple(items)), off


def sample(pool: SegmentPool, tree: Any, used: int, how: str) -> int:
    lease = pool.lease(used)  # untimed: the packer's part
    pool.hand_off(lease)
    packed = DiffusionOutput("r", PackedPayload(tree, lease, used, 0), async_output_id="o")
    t0 = time.perf_counter_ns()
    if how == "before":
        out = old_unpack(packed)
        old_release(out)
        del out
    elif how == "release":
        out = unpack_diffusion_output_shm(packed, pool=pool)
        release_unpacked_output(out)
        del out
    else:  # drop: the finalizer of the last view releases
        out = unpack_diffusion_output_shm(packed, pool=pool)
        del out
    dt = time.perf_counter_ns() - t0
    if pool.stats().outstanding:
        raise SystemExit(f"{how}: the segment did not go back")
    return dt


def run(rounds: int, per_round: int) -> list[dict[str, Any]]:
    sizes = [64 << 10, 4 << 20, 64 << 20]
    leaf_counts = [1, 20]
    variants = ["before", "release", "drop"]
    rows = []
    with SegmentPool(max_bytes=256 << 20, max_segments=8) as pool:
        for size in sizes:
            for leaves in leaf_counts:
                tree, used = make_tree(size, leaves)
                pool.prewarm(used)
                # The bytes, once: every sample views the same (touched) pages.
                lease = pool.lease(used)
                pool.view(lease)[:used].fill_(1)
                pool.release(lease)
                samples: dict[str, list[int]] = {v: [] for v in variants}
                for v in variants:  # warm-up
                    for _ in range(20):
                        sample(pool, tree, used, v)
                for r in range(rounds):
                    order = variants[r % 3 :] + variants[: r % 3]
                    for v in order:
                        for _ in range(per_round):
                            samples[v].append(sample(pool, tree, used, v))
                med = {v: statistics.median(s) / 1e3 for v, s in samples.items()}
                rows.append(
                    {
                        "bytes": size,
                        "leaves": leaves,
                        "samples_per_variant": rounds * per_round,
                        "median_us": {v: round(m, 2) for v, m in med.items()},
                        "p90_us": {v: round(float(np.percentile(s, 90)) / 1e3, 2) for v, s in samples.items()},
                        "ratio_to_before": {v: round(med[v] / med["before"], 3) for v in variants},
                    }
                )
    return rows


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "unpack_release.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = run(args.rounds, args.per_round)
    print(
        f"{'size':>8} {'leaves':>6} | {'before us':>9} {'release us':>10} {'drop us':>8} | {'release/before':>14} {'drop/before':>11}"
    )
    for row in rows:
        m, r = row["median_us"], row["ratio_to_before"]
        print(
            f"{fmt_size(row['bytes']):>8} {row['leaves']:>6} | {m['before']:>9.1f} {m['release']:>10.1f} {m['drop']:>8.1f} |"
            f" {r['release']:>14.2f} {r['drop']:>11.2f}"
        )
    result = {
        "command": " ".join(["PYTHONPATH=src", os.path.basename(sys.executable), *sys.argv]),
        "what": "median time per output of zero-copy unpack + giving the segment back (us); "
        "before = the code as of 670d0fa (vendored), release = unpack + release_unpacked_output, "
        "drop = unpack + del (the finalizer releases)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus (shared)",
        "when_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
