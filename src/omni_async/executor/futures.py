"""Future plumbing shared by the executors."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

__all__ = ["all_done", "map_future"]

T = TypeVar("T")
U = TypeVar("U")


def map_future(
    inner: Future[T],
    fn: Callable[[T], U],
    discard: Callable[[U], object] | None = None,
    run: Callable[[T, Callable[[], None]], None] | None = None,
) -> Future[U]:
    """``inner`` mapped by ``fn``; cancelling the outer future cancels the inner one.

    ``discard`` receives a mapped value whose outer future was cancelled meanwhile
    (so an output mapped for nobody still gives its segment back).  ``fn`` runs in the
    thread that resolves ``inner``, unless ``run`` is given: ``run(value, finish)`` is
    called there instead and must call ``finish()`` once, on any thread (a slow mapping
    -- a transfer -- handed to a thread of its own).
    """
    outer: Future[U] = Future()

    def finish(f: Future[T]) -> None:
        exc = f.exception()
        value: U | None = None
        if exc is None:
            try:
                value = fn(f.result())
            except BaseException as err:  # must reach the caller, not the callback logger
                exc = err
        if not outer.set_running_or_notify_cancel():
            if exc is None and discard is not None:
                discard(value)  # type: ignore[arg-type]  # set above whenever exc is None
            return
        if exc is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(value)  # type: ignore[arg-type]  # set above whenever exc is None

    def on_inner(f: Future[T]) -> None:
        if f.cancelled():
            outer.cancel()
        elif run is None or f.exception() is not None:
            finish(f)
        else:
            run(f.result(), lambda: finish(f))

    # Weakly: with a strong reference the two futures would hold each other (through
    # their callback lists) until a garbage collection, and with them the mapped value --
    # an unpacked output, whose views keep its segment out of the pool.  Until it is
    # resolved, whoever resolves ``inner`` holds it.
    inner_ref = weakref.ref(inner)

    def on_outer(f: Future[U]) -> None:
        i = inner_ref()
        if f.cancelled() and i is not None:
            i.cancel()

    outer.add_done_callback(on_outer)
    inner.add_done_callback(on_inner)
    return outer


def all_done(futures: list[Future[None]]) -> Future[None]:
    """A future resolved (None) once every one of ``futures`` is done, whatever their outcome."""
    done: Future[None] = Future()
    left = [len(futures)]
    if not futures:
        done.set_result(None)
        return done
    lock = threading.Lock()

    def one(_: Future[None]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and done.set_running_or_notify_cancel():
            done.set_result(None)

    for f in futures:
        f.add_done_callback(one)
    return done
