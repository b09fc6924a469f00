"""Option types shared by the ``omni-async`` commands.

Each raises ``argparse.ArgumentTypeError``, which argparse turns into a one-line
``omni-async <command>: error: argument --NAME: ...`` and exit status 2, before anything starts.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys

__all__ = ["default_device", "device", "image_side", "non_negative_int", "positive_int", "probability", "seconds"]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def probability(text: str) -> float:
    """A probability: a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text!r}")
    return value


def image_side(text: str) -> int:
    """An image side: latent-diffusion pipelines work on a grid 8 times smaller, so a multiple of 8."""
    value = positive_int(text)
    if value % 8:
        raise argparse.ArgumentTypeError(f"must be a multiple of 8, got {value}")
    return value


def seconds(text: str) -> float | None:
    """A deadline in seconds; 0 or ``none`` disables it (as in the ``OMNI_ASYNC_*_TIMEOUT`` variables)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds or 'none', got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return None if value == 0 else value


def cpu_affinity(text: str) -> str | tuple[int, ...]:
    """``gpu-local`` or a CPU list (``0-7,16``) for ``WorkerOptions.cpu_affinity``."""
    from omni_async.worker.affinity import GPU_LOCAL, parse_cpulist

    if text == GPU_LOCAL:
        return GPU_LOCAL
    try:
        cpus = parse_cpulist(text)
    except ValueError:
        cpus = frozenset()
    if not cpus:
        raise argparse.ArgumentTypeError(f"expected {GPU_LOCAL} or a CPU list such as 0-7,16, got {text!r}")
    return tuple(sorted(cpus))


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:<index>``, and CUDA only where a device is there."""
    import torch  # here, not at the top: ``omni-async --help`` does not import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:<index>, got {text!r}") from None
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:<index>, got {text!r}")
        return "cpu"
    if dev.type != "cuda":
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:<index>, got {text!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("CUDA requested but not available on this machine")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def default_device() -> str:
    """``cuda`` where torch sees a CUDA device (``torch.cuda.is_available()``), else ``cpu``.

    A CPU build of torch (a version ending in ``+cpu``) has none: that is known without
    importing torch, which takes seconds, so that ``omni-async bench --help`` does not.
    """
    if "torch" not in sys.modules:
        try:
            if importlib.metadata.version("torch").endswith("+cpu"):
                return "cpu"
        except importlib.metadata.PackageNotFoundError:
            pass
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
