"""``map_future``: the mapping runs where ``run`` puts it, exactly once, and a cancelled
outer future still hands the mapped value to ``discard``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from omni_async.executor.futures import map_future


def test_run_moves_the_mapping_to_another_thread() -> None:
    inner: Future[int] = Future()
    ran_on: list[str] = []
    threads: list[threading.Thread] = []

    def fn(x: int) -> int:
        ran_on.append(threading.current_thread().name)
        return x * 2

    def run(value: int, finish: Callable[[], None]) -> None:
        assert value == 21
        t = threading.Thread(target=finish, name="fetcher")
        threads.append(t)
        t.start()

    outer = map_future(inner, fn, run=run)
    inner.set_result(21)
    assert outer.result(timeout=5) == 42
    assert ran_on == ["fetcher"]
    threads[0].join()


def test_a_failed_inner_future_skips_run() -> None:
    inner: Future[int] = Future()
    called: list[int] = []
    outer = map_future(inner, lambda x: x, run=lambda v, finish: called.append(v))
    inner.set_exception(ValueError("boom"))
    assert isinstance(outer.exception(timeout=5), ValueError) and called == []


def test_a_value_mapped_for_a_cancelled_waiter_is_discarded() -> None:
    inner: Future[int] = Future()
    pending: list[Callable[[], None]] = []
    discarded: list[int] = []
    outer = map_future(inner, lambda x: x + 1, discard=discarded.append, run=lambda v, finish: pending.append(finish))
    inner.set_result(1)
    assert outer.cancel()  # cancelled while the mapping waits for its thread
    pending[0]()
    assert discarded == [2]
