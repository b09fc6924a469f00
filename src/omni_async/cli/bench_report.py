"""``omni-async bench``'s printed report: the table (fits 100 columns; every field is in the
JSON) and, on CPU, a paragraph on what the figures there do and do not mean."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import Any, Final

import torch
from rich import box
from rich.table import Table

from omni_async.cli import bench_plot

__all__ = ["COLUMNS", "CPU_NOTE", "LEGEND", "TABLE_WIDTH", "environment", "table"]

#: The width the table is laid out for (a terminal's 100 columns; wider ones leave it so).
TABLE_WIDTH: Final = 100

#: (header, the case's field, format): the table's columns; the JSON has every field.
COLUMNS: Final[tuple[tuple[str, str, str], ...]] = (
    ("mode", "mode", ""),
    ("size", "size", ""),
    ("forward", "forward_label", ""),
    ("c", "concurrency", "d"),
    ("req/s", "throughput_rps", "n"),
    ("eff", "efficiency", ".2f"),
    ("p50", "latency_ms_p50", "n"),
    ("client", "client_ms_p50", "n"),
    ("c.eff", "client_efficiency", ".2f"),
    ("idle", "idle_gap_ms_p50", ".2f"),
    ("GB/s", "copy_GBps", ".1f"),
)
#: What the short headers mean, printed under the table.
LEGEND: Final = (
    "eff: req/s over the ideal 1 / max(forward, bytes / pinned copy bandwidth); p50: ms to the output in "
    "hand; client: ms to the client's bytes (host post-process done), c.eff: the forward alone over it "
    "(the ideal); idle: the device's median gap between forwards, ms; GB/s: the worker's copy.  Every "
    "field is in the JSON."
)

CPU_NOTE: Final = (
    "On CPU these figures measure the protocol and host copies, not a GPU's gain.  The "
    "'device' is the CPU itself: a copy is a memcpy, and there is no separate device to keep "
    "busy, so the packer's copy competes with the next forward for the same cores (the "
    "forward is a sleep here, which leaves them free only in part), and `omni` cannot beat "
    "`sync` by much.  The copy-bound cases divide by a pinned-copy bandwidth measured alone: "
    "a memcpy into a buffer the copy loop keeps hot in cache, which a real output going to "
    "shared memory (page faults, cold cache, a second process) does not reach -- hence "
    "efficiencies well below 1 there.  Run with --device cuda on a GPU for the overlap the "
    "library is for."
)


def _fmt(value: Any, spec: str) -> str:
    """``spec`` "n": 3 significant digits below 100, whole numbers above (a narrow column)."""
    if value is None:
        return "-"
    if spec == "n":
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}" if abs(value) >= 1 else f"{value:.2f}"
    return format(value, spec) if spec else str(value)


def table(cases: Sequence[dict[str, Any]], title: str) -> Table:
    """The cases' main figures: requests/s and efficiency (against ``1 / max(forward,
    bytes / pinned copy bandwidth)``), p50 latency to the output in hand and to the
    client's bytes (``client eff.``: the forward alone over that time, the ideal being
    the forward alone), the device's idle gap between forwards, the copy's rate."""
    t = Table(
        title=title,
        caption=LEGEND,
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        collapse_padding=True,
        pad_edge=False,
        show_edge=False,
    )
    for header, _, spec in COLUMNS:
        t.add_column(header, justify="right" if spec else "left", no_wrap=True)
    for c in cases:
        t.add_row(*(_fmt(c.get(field), spec) for _, field, spec in COLUMNS))
    return t


def environment(device: str) -> dict[str, Any]:
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "device_name": name,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "matplotlib": bench_plot.have_matplotlib(),
    }
