"""The last mile (issue 20): uint8 finalize eager vs fused, and encode per image.

Rows:

* **finalize**: ``bench-u8``'s conversion (``models.synthetic.u8_eager``: multiply, add,
  clamp, cast; four passes) against the same fused into one ``torch.compile`` kernel
  (``worker.finalize.FusedPointwise``), on a 121-frame 1080p bf16 video (1.5 GB) and a
  batch of eight 1024x1024 RGB bf16 images; milliseconds, GB/s of input, and whether the
  two agree bit for bit.  On the CPU the fused rows compile Inductor's C++ kernel (the
  worker itself runs eager there).
* **encode**: one RGB image (a smooth picture with a little noise, as a decoder makes)
  at 1024x1024 and 2048x2048: Pillow PNG at level 1 and 6, Pillow JPEG q90, Pillow
  lossless WebP, each on one CPU core; on CUDA, ``torchvision.io.encode_jpeg`` (nvJPEG)
  in batches of 8, per image.

Prints a table and writes JSON (``--json``).  On an H200:

    PYTHONPATH=src python3 bench/last_mile.py --device cuda --json bench/results/last_mile_h200.json

On a CPU machine (``--frames`` shrinks the video when memory is short):

    PYTHONPATH=src python3 bench/last_mile.py --device cpu --frames 24 --json /tmp/last_mile_cpu.json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch

from omni_async.core.encoding import Encoding
from omni_async.engine.encoders import encode_image
from omni_async.models.synthetic import u8_eager
from omni_async.worker.finalize import FusedPointwise

Row = dict[str, object]


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """The median seconds of ``fn`` over ``repeat`` runs (after one warm run), the device's included."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def finalize_rows(device: torch.device, frames: int, repeat: int) -> list[Row]:
    fused = FusedPointwise(u8_eager, devices=(device.type,))
    cases = {
        f"video {frames}x1080p bf16": (frames, 1080, 1920, 3),
        "images 8x1024x1024 bf16": (8, 1024, 1024, 3),
    }
    rows: list[Row] = []
    for name, shape in cases.items():
        gen = torch.Generator(device=device).manual_seed(0)
        x = (torch.rand(shape, device=device, generator=gen) * 2.4 - 1.2).to(torch.bfloat16)
        nbytes = x.numel() * x.element_size()
        t0 = time.perf_counter()
        fused.warm_up(device, [torch.bfloat16])
        compile_s = time.perf_counter() - t0
        identical = bool(torch.equal(fused(x), u8_eager(x)))
        for path, fn in (("eager (4 passes)", u8_eager), ("fused (torch.compile)", fused)):
            s = timed(lambda fn=fn, x=x: fn(x), device, repeat)
            rows.append(
                {
                    "kind": "finalize",
                    "case": name,
                    "path": path,
                    "ms": 1e3 * s,
                    "gb_per_s": nbytes / s / 1e9,
                    "input_gb": nbytes / 1e9,
                    "identical": identical,
                    "status": fused.status(device, torch.bfloat16) if path.startswith("fused") else "eager",
                    "compile_s": compile_s if path.startswith("fused") else None,
                }
            )
        del x
    return rows


def smooth_image(size: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    rng = np.random.default_rng(seed)
    chans = [
        127 + 90 * np.sin(x / (37 + 9 * i) + y / (53 + 5 * i) + seed) + rng.normal(0, 6, (size, size)) for i in range(3)
    ]
    out: npt.NDArray[np.uint8] = np.clip(np.stack(chans, -1), 0, 255).astype(np.uint8)
    return out


def encode_rows(device: torch.device, sizes: list[int], repeat: int) -> list[Row]:
    rows: list[Row] = []
    for size in sizes:
        image = smooth_image(size)
        for label, encoding in (
            ("Pillow PNG level 1", Encoding("png", 1)),
            ("Pillow PNG level 6", Encoding("png", 6)),
            ("Pillow JPEG q90", Encoding("jpeg", 90)),
            ("Pillow WebP lossless", Encoding("webp")),
        ):
            data = encode_image(image, encoding)
            s = timed(lambda e=encoding, im=image: encode_image(im, e), torch.device("cpu"), repeat)
            rows.append(
                {"kind": "encode", "case": f"{size}x{size} RGB", "path": label, "ms": 1e3 * s, "bytes": len(data)}
            )
        if device.type == "cuda":
            rows.append(_nvjpeg_row(device, image, size, repeat))
    return rows


def _nvjpeg_row(device: torch.device, image: npt.NDArray[np.uint8], size: int, repeat: int) -> Row:
    case = f"{size}x{size} RGB"
    try:
        from torchvision.io import encode_jpeg
    except ImportError as exc:
        return {"kind": "encode", "case": case, "path": "nvJPEG q90 (batch 8)", "ms": None, "note": str(exc)}
    chw = torch.from_numpy(image).to(device).permute(2, 0, 1).contiguous()
    batch = [chw.clone() for _ in range(8)]
    encoded: list[torch.Tensor] = encode_jpeg(batch, quality=90)
    s = timed(lambda: encode_jpeg(batch, quality=90), device, repeat)
    from PIL import Image

    decoded = Image.open(io.BytesIO(encoded[0].cpu().numpy().tobytes()))
    return {
        "kind": "encode",
        "case": case,
        "path": "nvJPEG q90 (batch 8, per image)",
        "ms": 1e3 * s / 8,
        "bytes": int(encoded[0].numel()),
        "decodes_to": list(decoded.size),
    }


def print_table(rows: list[Row]) -> None:
    print(f"{'kind':9} {'case':26} {'path':32} {'ms':>10} {'GB/s':>9} {'bytes':>10}  note")
    for r in rows:
        ms = "-" if r.get("ms") is None else f"{r['ms']:.3f}"
        gbs = f"{r['gb_per_s']:.1f}" if "gb_per_s" in r else ""
        size = str(r.get("bytes", ""))
        note = ""
        if r["kind"] == "finalize":
            note = f"identical={r['identical']} {r['status']}"
            if r.get("compile_s") is not None:
                note += f" (warm-up {r['compile_s']:.1f} s)"
        elif "note" in r:
            note = str(r["note"])
        print(f"{r['kind']:9} {r['case']:26} {r['path']:32} {ms:>10} {gbs:>9} {size:>10}  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--frames", type=int, default=121, help="frames of the 1080p video (121: 1.5 GB in bf16)")
    parser.add_argument("--sizes", default="1024,2048", help="square image sizes to encode, comma-separated")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-finalize", action="store_true")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    rows: list[Row] = []
    if not args.skip_finalize:
        rows += finalize_rows(device, args.frames, args.repeat)
    rows += encode_rows(device, [int(s) for s in args.sizes.split(",")], args.repeat)
    print_table(rows)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
