"""A remote exception as plain data, so it always pickles and never loses its cause (F2)."""

from __future__ import annotations

import traceback as _tb

import attrs

__all__ = ["Failure"]


@attrs.frozen
class Failure:
    """A remote exception, reduced to plain strings so it always pickles."""

    type_name: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, exc: BaseException) -> Failure:
        return cls(
            type_name=type(exc).__qualname__,
            message=str(exc),
            traceback="".join(_tb.format_exception(type(exc), exc, exc.__traceback__)),
        )
