"""Catch what a finalizer would otherwise only print: unraisable errors, thread errors, error logs.

A ``weakref.finalize`` callback that raises does not fail anything: Python hands the
error to ``sys.unraisablehook`` (or prints it at exit), and a thread's to
``threading.excepthook``.  ``quiet_finalizers`` records all three, plus WARNING and
above from the ``omni_async`` loggers, so a test can assert that releasing a segment
from a finalizer raised nothing and complained about nothing.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class _Collect(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(f"log {record.name}: {record.getMessage()}")


@contextmanager
def quiet_finalizers() -> Iterator[list[str]]:
    """Yields the list of everything caught; the caller asserts it is empty."""
    caught: list[str] = []
    old_unraisable = sys.unraisablehook
    old_thread = threading.excepthook

    def on_unraisable(u: Any) -> None:
        caught.append(f"unraisable {u.exc_type.__name__}: {u.exc_value} ({u.object!r})")

    def on_thread(a: Any) -> None:
        caught.append(f"thread {a.exc_type.__name__}: {a.exc_value}")

    handler = _Collect(caught)
    logger = logging.getLogger("omni_async")
    sys.unraisablehook = on_unraisable
    threading.excepthook = on_thread
    logger.addHandler(handler)
    try:
        yield caught
    finally:
        logger.removeHandler(handler)
        sys.unraisablehook = old_unraisable
        threading.excepthook = old_thread
