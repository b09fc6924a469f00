"""Per-output stats: what the worker measured of one output, as a typed record.

``DiffusionOutput.metrics`` was a string-keyed dict of floats; it is an ``OutputStats``
now, one optional field per key the library writes (the packer's times and bytes, the
worker's timestamps, a device stage's time), so a producer's misspelt key is a type
error, not a silent new key.  Model authors may add their own keys: a model's
``DiffusionOutput(metrics={...})`` is converted (``as_stats``), its keys the library
knows into fields and the others into ``extra`` -- the record stays open for them.

It also reads as the ``Mapping[str, float]`` it replaced (the fields that are set, then
``extra``): the engine hands each result's stats to its caller as a dict
(``GenerationResult.metrics``), and code written against the dict keeps working.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs

__all__ = ["OutputStats", "as_stats"]


def _extra(values: Mapping[str, float]) -> dict[str, float]:
    return dict(values)


@attrs.frozen
class OutputStats(Mapping[str, float]):
    """One output's stats (None: not measured).  Times in seconds; ``*_at``: ``time.monotonic()``."""

    # The packer (``transport.packing``; ``bench.paths`` for the comparison paths);
    # the worker's ``pack_s`` is ``pack_ended_at - pack_started_at`` (``worker.stamps``).
    pack_s: float | None = None
    pack_shm_bytes: float | None = None
    pack_inline_bytes: float | None = None
    pack_stored_bytes: float | None = None
    pack_pinned: float | None = None
    pack_segments: float | None = None
    # The worker's timestamps (``worker.stamps``): the forward and the pack on the
    # device, converted to the host's clock; ``forward_returned_at`` on the host.
    forward_started_at: float | None = None
    forward_ended_at: float | None = None
    forward_returned_at: float | None = None
    pack_started_at: float | None = None
    pack_ended_at: float | None = None
    # A post-process device stage's device time (``worker.postprocess``), apart from the pack's.
    device_postprocess_s: float | None = None
    # A request's JPEG encoded on the worker's GPU (``worker.encode``): its seconds, and
    # the bytes of the images before (``device_encode_in_bytes``) and after.
    device_encode_s: float | None = None
    device_encode_in_bytes: float | None = None
    device_encode_out_bytes: float | None = None
    # A model's own keys (open-ended: any name the fields above do not take).
    extra: Mapping[str, float] = attrs.field(factory=dict, converter=_extra, kw_only=True)

    def __attrs_post_init__(self) -> None:
        clash = sorted(set(self.extra) & _FIELDS)
        if clash:
            raise ValueError(f"OutputStats.extra names a field of its own: {clash}")

    def set(self, **values: float) -> OutputStats:
        """These stats with ``values`` added: the fields it names, other keys into ``extra``."""
        return as_stats({**self, **values})

    # The Mapping view --------------------------------------------------------------

    def __getitem__(self, key: str) -> float:
        if key in _FIELDS:
            value: float | None = getattr(self, key)
            if value is not None:
                return value
            raise KeyError(key)
        return self.extra[key]

    def __iter__(self) -> Iterator[str]:
        for name in _ORDER:
            if getattr(self, name) is not None:
                yield name
        yield from self.extra

    def __len__(self) -> int:
        return sum(1 for _ in self)


_ORDER: tuple[str, ...] = tuple(a.name for a in attrs.fields(OutputStats) if a.name != "extra")
_FIELDS: frozenset[str] = frozenset(_ORDER)


def as_stats(values: Mapping[str, float] | None = None) -> OutputStats:
    """``values`` as an ``OutputStats``: an ``OutputStats`` as it is, a mapping's keys the
    record knows into its fields and the others into ``extra``."""
    if isinstance(values, OutputStats):
        return values
    if values is None:
        return OutputStats()
    extra = {k: v for k, v in values.items() if k not in _FIELDS}
    return OutputStats(*(values.get(name) for name in _ORDER), extra=extra)
