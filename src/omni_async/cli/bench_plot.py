"""The plot of ``omni-async bench``: efficiency and throughput per case and mode, from the JSON report.

Drawn from the report alone (``omni-async bench --plot-from JSON`` redraws a saved one),
with matplotlib's Agg backend, imported only here and only when drawing: a machine
without matplotlib (the GPU machine) runs the bench and skips the plot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["case_label", "draw", "have_matplotlib"]

# One colour per mode, the same in both panels.
_COLOURS = {"sync": "#c44e52", "reference": "#dd8452", "omni": "#4c72b0", "omni-u8": "#55a868"}


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def case_label(case: Mapping[str, Any]) -> str:
    """A case's label on the x axis: size, forward and concurrency (the mode is the bar)."""
    return f"{case['size']}\n{case['forward_label']}\nc={case['concurrency']}"


def draw(report: Mapping[str, Any], path: Path) -> Path:
    """Draw ``report``'s cases to the PNG ``path``; returns it.  ``ImportError`` without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases: Sequence[Mapping[str, Any]] = report["cases"]
    modes = [m for m in report["config"]["modes"] if any(c["mode"] == m for c in cases)]
    labels: list[str] = []
    for c in cases:
        if case_label(c) not in labels:
            labels.append(case_label(c))
    width = 0.8 / max(1, len(modes))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8.0, 1.1 * len(labels) + 3), 9), sharex=True)
    for i, mode in enumerate(modes):
        by_label = {case_label(c): c for c in cases if c["mode"] == mode}
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(labels))]
        eff = [by_label[lbl]["efficiency"] if lbl in by_label else 0.0 for lbl in labels]
        rps = [by_label[lbl]["throughput_rps"] if lbl in by_label else 0.0 for lbl in labels]
        colour = _COLOURS.get(mode)
        top.bar(xs, eff, width, label=mode, color=colour)
        bottom.bar(xs, rps, width, label=mode, color=colour)
    top.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    highest = max((c["efficiency"] for c in cases), default=1.0)
    top.set_ylim(0, max(1.0, highest) * 1.25)  # room for the legend above the bars
    top.set_ylabel("efficiency (throughput / ideal)")
    top.set_title("efficiency: 1.0 = max(forward, bytes / pinned copy bandwidth) per request")
    top.legend(loc="upper left", ncols=len(modes), fontsize="small")
    bottom.set_ylabel("throughput (requests/s)")
    bottom.set_yscale("log")
    bottom.set_title("throughput (log scale)")
    bottom.set_xticks(range(len(labels)), labels, fontsize="x-small")
    env = report.get("environment", {})
    fig.suptitle(
        f"omni-async bench on {env.get('device_name', '?')} ({env.get('device', '?')}), "
        f"torch {env.get('torch', '?')}, {report.get('date', '')}",
        fontsize="medium",
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
