"""``ServeConfig``: what ``omni-async serve`` serves and how, checked when made."""

from __future__ import annotations

from typing import Any

import attrs

from omni_async.core.config import InvalidConfig
from omni_async.engine.config import DEFAULT_MAX_WAITING
from omni_async.executor.multiproc import WorkerOptions
from omni_async.serve.models import ServedModel

__all__ = ["ServeConfig"]


def _positive(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InvalidConfig(f"ServeConfig.{attr.name}", f"must be a positive number, got {value!r:.40}")


def _optional_positive(inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        _positive(inst, attr, value)


@attrs.frozen(kw_only=True)
class ServeConfig:
    """The server's settings.

    ``model``: what it serves; ``device``: where the workers compute; the engine's
    ``max_waiting`` (its queue: full, a 429), ``max_batch_size`` (an ``n`` of up to this
    many images is one batched forward), ``max_running`` (None: the engine's default),
    ``encode_workers`` (the encoder processes; None: one per core) and the executor's
    ``max_held_outputs`` (None: its default); ``poll_after_ms``: the ``openai-poll-after-ms``
    a video job's status answers with (the openai client polls at that pace);
    ``video_keep_s``: how long a finished video job (and its MP4) is kept;
    ``output_ttl_s``: how long an image asked for with ``response_format="url"`` stays
    at its URL (the engine's file sink deletes it then);
    ``graceful_s``: how long a SIGTERM waits for the requests in flight to end before it
    closes the engine (which fails the rest); ``cpu_affinity``: the CPUs each worker
    process runs on (``WorkerOptions.cpu_affinity``: None, ``"gpu-local"`` or CPU numbers)."""

    model: ServedModel
    device: str = "cpu"
    max_waiting: int = attrs.field(default=DEFAULT_MAX_WAITING, validator=_positive)
    max_batch_size: int = attrs.field(default=4, validator=_positive)
    max_running: int | None = attrs.field(default=None, validator=_optional_positive)
    encode_workers: int | None = attrs.field(default=None, validator=_optional_positive)
    max_held_outputs: int | None = attrs.field(default=None, validator=_optional_positive)
    poll_after_ms: int = attrs.field(default=1000, validator=_positive)
    video_keep_s: float = attrs.field(default=600.0, validator=_positive)
    output_ttl_s: float = attrs.field(default=600.0, validator=_positive)
    graceful_s: float = attrs.field(default=30.0, validator=_positive)
    cpu_affinity: str | tuple[int, ...] | None = None

    def worker_options(self) -> WorkerOptions:
        """The workers' options these settings make (checked when the config is made)."""
        return WorkerOptions(device=self.device, cpu_affinity=self.cpu_affinity)

    def __attrs_post_init__(self) -> None:
        self.worker_options()  # InvalidConfig names WorkerOptions' field
