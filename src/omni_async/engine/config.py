"""``EngineConfig``: every setting of ``AsyncDiffusionEngine`` in one validated object.

The engine takes it (``AsyncDiffusionEngine(executor, config=EngineConfig(...))``) or the
same names as keyword arguments, which build one; ``from_factory`` and the blocking
``DiffusionEngine`` take the same two forms.  Every field is checked when the object is
made (wrong type, NaN, infinity, zero or a negative number where it cannot work), with
``InvalidConfig`` (a ``UsageError``) whose ``field`` names it, so a bad setting fails at
the line that wrote it instead of a request later.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import attrs

from omni_async.core.trace import Tracer
from omni_async.executor.config import InvalidConfig
from omni_async.executor.submitter import BatchKeyer

__all__ = [
    "DEFAULT_BATCH_WAIT_S",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_MAX_RUNNING_BATCHES",
    "DEFAULT_MAX_WAITING",
    "DEFAULT_OUTPUT_TTL_S",
    "DEFAULT_VIDEO_BYTES_IN_FLIGHT",
    "EngineConfig",
    "EngineOptions",
    "engine_config",
]

# Requests sent to the executor whose forward has not finished.  3: one computing and
# two queued behind it on the worker, so the engine has a whole forward of slack to send
# the next one -- a loop held up by host work or a busy consumer for longer than one
# forward no longer leaves the worker idle (with 2 it did: bench/engine_ceiling.py,
# ``starved``).  A batch's members count one by one: ``DEFAULT_MAX_RUNNING_BATCHES``
# batches (one computing, one queued: a batch's forward is longer, and requests sent
# ahead could not join a later batch).
DEFAULT_MAX_RUNNING = 3
DEFAULT_MAX_RUNNING_BATCHES = 2
# How long a batch that could take more members waits for them (seconds).
DEFAULT_BATCH_WAIT_S = 0.002
DEFAULT_MAX_WAITING = 4096
# Without a budget reported by the executor (InProcessExecutor): how many requests may
# be running or holding an output at once.
DEFAULT_MAX_IN_FLIGHT = 64
# How long a file (sink="file") or a segment lease (sink="segment") lives by default.
DEFAULT_OUTPUT_TTL_S = 600.0
# Frames of a video handed to its encoder and not yet encoded: a few parts of a 720p
# video (16 frames of 1280x720 RGB: 44 MB), so the encoder never waits for the next part,
# while the rest wait in shared memory within the budget of held outputs.
DEFAULT_VIDEO_BYTES_IN_FLIGHT = 256 * 2**20


def _count(name: str, *, optional: bool = False) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """A positive int (or None when ``optional``); a bool is refused although it is an int."""

    def check(_inst: object, _attr: attrs.Attribute[Any], value: object) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidConfig(name, f"must be a positive int{' or None' if optional else ''}, got {value!r:.80}")

    return check


def _seconds(name: str, *, zero: bool) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """A finite number of seconds, > 0 (or >= 0 when ``zero`` means something)."""

    def check(_inst: object, _attr: attrs.Attribute[Any], value: object) -> None:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        if ok and (value < 0 if zero else value <= 0):  # type: ignore[operator]  # a finite int or float here
            ok = False
        if not ok:
            bound = ">= 0" if zero else "> 0"
            raise InvalidConfig(name, f"must be a finite number of seconds {bound}, got {value!r:.80}")

    return check


def _optional_str(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidConfig(attr.name, f"must be a registered post-process name (str) or None, got {value!r:.80}")


def _bool(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidConfig(attr.name, f"must be a bool, got {value!r:.80}")


def _optional_callable(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise InvalidConfig(attr.name, f"must be a callable or None, got {value!r:.80}")


def _optional_dir(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    # Only the type here: whether the directory exists or can be made is the engine's
    # start to find out (file I/O, off the event loop), with the path in its error.
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidConfig(
            attr.name, f"must be a directory path (a non-empty str) or None (a private one), got {value!r:.80}"
        )


def _float(value: object) -> object:
    # An int number of seconds is kept as a float; anything else is left for the validator.
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


@attrs.frozen(kw_only=True)
class EngineConfig:
    """The engine's settings.

    ``pipeline``: the name of a registered ``PostProcess`` whose ``host`` stage turns each
    output into the caller's result (``UnknownPostProcess`` at once if none is
    registered); without one the result is an owned copy of the model's output.  A
    request may choose its own (``DiffusionRequest(..., postprocess="name")``, checked
    at ``generate``).  ``max_running``: requests sent to the executor whose forward has
    not finished, batch members counted one by one (default 3: one computing, two queued
    behind it on the worker, so a loop held up for a forward's time leaves the worker
    busy; with batching ``2 * max_batch_size``: one batch computing, one queued); ``max_batch_size`` (1: no batching):
    requests with equal batch keys go to the workers together, up to this many, in one
    ``execute_model_batch`` (``omni_async.engine.sending``); ``batch_wait_s`` (2 ms;
    0: take what waits): how long a batch that could take more members waits for them;
    ``batch_key`` (``request -> key or None``): which requests may share a batch,
    instead of the executor's ``batch_key`` (the model's); ``max_waiting``: the engine's queue,
    beyond the running slots free at the call (full: ``EngineOverloaded`` at the call); ``max_in_flight``: cap on running requests plus
    outputs not yet released, in addition to the executor's budget of held outputs
    (default: that budget, or 64 for an executor without one); ``postprocess_workers``:
    threads running host stages; ``async_output`` (True): False sends every request down
    the executor's synchronous output path instead (``execute_request(sync_output=True)``:
    the worker copies each output on its main thread before it answers, and the calls
    run one at a time) -- the baseline the asynchronous path is measured against
    (``omni-async demo``), not a way to serve: a request whose call is in flight cannot
    be cancelled (an abort waits for its forward, then releases its output).
    ``encode_workers``: the processes that encode the requests that ask for a format
    (``DiffusionRequest(..., format="png")``; default ``os.cpu_count()``), started with
    the first such request and stopped by ``close`` (``omni_async.engine.encode_pool``).
    ``output_dir``: where the requests with ``sink="file"`` have their files written (None:
    a private directory the engine makes at start under ``tempfile.gettempdir()`` and
    removes at close; a directory given is made if missing, and kept at close, only the
    engine's files removed); ``output_ttl_s`` (600 s): how long such a file, or a
    ``sink="segment"`` lease, lives when its request gives no ``sink_ttl_s``
    (``omni_async.engine.sinks``).
    ``video_bytes_in_flight`` (256 MiB): a video encoded while it decodes
    (``generate_video``) hands the encoder at most this many bytes of frames not yet
    encoded (one part larger than it goes alone); the parts behind wait in shared memory
    (``omni_async.engine.video``).
    ``close_timeout`` (60 s): the default bound of ``close`` and of a stream's ``aclose``.
    ``tracer``: records every step of the engine's machines (``omni_async.core.engine_trace``).
    """

    pipeline: str | None = attrs.field(default=None, validator=_optional_str)
    max_running: int | None = attrs.field(default=None, validator=_count("max_running", optional=True))
    max_waiting: int = attrs.field(default=DEFAULT_MAX_WAITING, validator=_count("max_waiting"))
    max_in_flight: int | None = attrs.field(default=None, validator=_count("max_in_flight", optional=True))
    postprocess_workers: int = attrs.field(default=2, validator=_count("postprocess_workers"))
    close_timeout: float = attrs.field(default=60.0, converter=_float, validator=_seconds("close_timeout", zero=False))
    async_output: bool = attrs.field(default=True, validator=_bool)
    tracer: Tracer | None = attrs.field(default=None, validator=_optional_callable)
    max_batch_size: int = attrs.field(default=1, validator=_count("max_batch_size"))
    batch_wait_s: float = attrs.field(
        default=DEFAULT_BATCH_WAIT_S, converter=_float, validator=_seconds("batch_wait_s", zero=True)
    )
    batch_key: BatchKeyer | None = attrs.field(default=None, validator=_optional_callable)
    encode_workers: int | None = attrs.field(default=None, validator=_count("encode_workers", optional=True))
    output_dir: str | None = attrs.field(default=None, validator=_optional_dir)
    output_ttl_s: float = attrs.field(
        default=DEFAULT_OUTPUT_TTL_S, converter=_float, validator=_seconds("output_ttl_s", zero=False)
    )
    video_bytes_in_flight: int = attrs.field(
        default=DEFAULT_VIDEO_BYTES_IN_FLIGHT, validator=_count("video_bytes_in_flight")
    )

    def __attrs_post_init__(self) -> None:
        mr = self.max_running
        if mr is not None and mr < self.max_batch_size:
            raise InvalidConfig(
                "max_running",
                f"({mr}) is below max_batch_size ({self.max_batch_size}): the members of a batch count as "
                f"running requests, so no batch could fill; raise max_running to at least {self.max_batch_size} "
                "(2 x max_batch_size keeps a batch queued behind the running one), or leave it out for that default",
            )

    @property
    def running_slots(self) -> int:
        """``max_running``, or its default: 3 alone, two batches' members with batching."""
        if self.max_running is not None:
            return self.max_running
        if self.max_batch_size == 1:
            return DEFAULT_MAX_RUNNING
        return DEFAULT_MAX_RUNNING_BATCHES * self.max_batch_size


class EngineOptions(TypedDict, total=False):
    """``EngineConfig``'s fields as keyword arguments (the engine's keyword form)."""

    pipeline: str | None
    max_running: int | None
    max_waiting: int
    max_in_flight: int | None
    postprocess_workers: int
    close_timeout: float
    async_output: bool
    tracer: Tracer | None
    max_batch_size: int
    batch_wait_s: float
    batch_key: BatchKeyer | None
    encode_workers: int | None
    output_dir: str | None
    output_ttl_s: float
    video_bytes_in_flight: int


def engine_config(config: EngineConfig | None, options: Mapping[str, object], what: str) -> EngineConfig:
    """``config``, or one made of the keyword ``options`` (not both)."""
    if config is not None:
        if not isinstance(config, EngineConfig):
            raise InvalidConfig("config", f"must be an EngineConfig or None, got {config!r:.80}")
        if options:
            raise InvalidConfig(
                "config", f"{what}: give an EngineConfig or keyword settings, not both (got {sorted(options)})"
            )
        return config
    unknown = sorted(set(options) - set(attrs.fields_dict(EngineConfig)))
    if unknown:
        raise InvalidConfig(unknown[0], f"is not a setting of the engine ({what}); EngineConfig has {_names()}")
    return EngineConfig(**options)  # type: ignore[arg-type]  # each value is checked by its field's validator


def _names() -> str:
    return ", ".join(attrs.fields_dict(EngineConfig))
