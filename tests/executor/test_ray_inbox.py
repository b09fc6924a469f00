"""The Ray actor's inbox on its own: RPCs handed to the worker loop in per-rank sequence order.

A threaded actor runs its concurrent ``rpc`` calls in whatever order Ray picks; a local
cluster practically never reorders them, so the executor tests cannot tell an inbox that
orders by sequence number from one that hands over in arrival order.  These tests drive
``_OrderedInbox`` directly from threads, no Ray needed.
"""

from __future__ import annotations

import queue
import threading
import time

from omni_async.core.messages import RpcRequest
from omni_async.worker.ray_actor import OrderedInbox as _OrderedInbox

TIMEOUT = 10.0
# How long a consumer is given to (wrongly) take something it must not have yet.
SETTLE = 0.2


def rpc(seq: int) -> RpcRequest:
    return RpcRequest(rpc_id=f"rpc-{seq}", method="execute_model")


class Consumer:
    """The actor's loop thread: takes from the inbox until it gets the stop (None)."""

    def __init__(self, inbox: _OrderedInbox) -> None:
        self.got: queue.Queue[RpcRequest | None] = queue.Queue()
        self._inbox = inbox
        self._thread = threading.Thread(target=self._run, name="inbox-consumer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            req = self._inbox.get()
            self.got.put(req)
            if req is None:
                return

    def next(self) -> str | None:
        req = self.got.get(timeout=TIMEOUT)
        return None if req is None else req.rpc_id

    def nothing_yet(self) -> bool:
        time.sleep(SETTLE)
        return self.got.empty()

    def join(self) -> None:
        self._thread.join(TIMEOUT)
        assert not self._thread.is_alive()


def deliver(inbox: _OrderedInbox, seq: int, req: RpcRequest | None) -> None:
    """One ``RankActor.rpc`` call on its own actor thread; returns once it has been put."""
    t = threading.Thread(target=inbox.put, args=(seq, req), name=f"actor-rpc-{seq}")
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive()


def test_rpcs_arriving_out_of_order_are_handed_over_in_sequence_order() -> None:
    """Seq 2, then 0, then 1, each from its own thread, before the loop reads: 0, 1, 2."""
    inbox = _OrderedInbox()
    for seq in (2, 0, 1):
        deliver(inbox, seq, rpc(seq))
    deliver(inbox, 3, None)  # the stop, last in sequence
    consumer = Consumer(inbox)
    assert [consumer.next() for _ in range(4)] == ["rpc-0", "rpc-1", "rpc-2", None]
    consumer.join()


def test_a_waiting_loop_gets_nothing_until_the_next_sequence_number_arrives() -> None:
    """The loop is already waiting: seq 2 arriving first is held until 0 and 1 came."""
    inbox = _OrderedInbox()
    consumer = Consumer(inbox)
    deliver(inbox, 2, rpc(2))
    assert consumer.nothing_yet(), "seq 2 was handed over before seq 0"
    deliver(inbox, 0, rpc(0))
    assert consumer.next() == "rpc-0"
    assert consumer.nothing_yet(), "seq 2 was handed over before seq 1"
    deliver(inbox, 1, rpc(1))
    assert [consumer.next(), consumer.next()] == ["rpc-1", "rpc-2"]
    deliver(inbox, 3, None)
    assert consumer.next() is None
    consumer.join()


def test_a_stop_that_overtakes_an_rpc_waits_for_it() -> None:
    """``stop`` carries the next sequence number: arriving before the last RPC, it still
    reaches the loop after it (the RPC is not lost behind the stop)."""
    inbox = _OrderedInbox()
    consumer = Consumer(inbox)
    deliver(inbox, 0, rpc(0))
    assert consumer.next() == "rpc-0"
    deliver(inbox, 2, None)
    assert consumer.nothing_yet(), "the stop overtook rpc 1"
    deliver(inbox, 1, rpc(1))
    assert [consumer.next(), consumer.next()] == ["rpc-1", None]
    consumer.join()


def test_a_gap_blocks_and_a_number_already_handed_over_is_never_handed_over_again() -> None:
    """A gap (seq 1 never sent yet) holds back every later RPC; a repeat of a number the
    loop already took is not handed over a second time (only ``next`` is ever taken)."""
    inbox = _OrderedInbox()
    consumer = Consumer(inbox)
    deliver(inbox, 0, rpc(0))
    assert consumer.next() == "rpc-0"
    deliver(inbox, 0, RpcRequest(rpc_id="rpc-0-again", method="execute_model"))
    deliver(inbox, 2, rpc(2))
    deliver(inbox, 3, rpc(3))
    assert consumer.nothing_yet(), "the gap at seq 1 was skipped, or seq 0 handed over twice"
    deliver(inbox, 1, rpc(1))
    assert [consumer.next(), consumer.next(), consumer.next()] == ["rpc-1", "rpc-2", "rpc-3"]
    deliver(inbox, 4, None)
    assert consumer.next() is None
    consumer.join()


def test_many_threads_delivering_at_once_in_sequence_order() -> None:
    """Eight actor threads deliver 200 numbers in a shuffled order, all at once."""
    n, threads = 200, 8
    inbox = _OrderedInbox()
    consumer = Consumer(inbox)
    order = list(range(n))
    order.reverse()  # the worst case: every number arrives after all the larger ones of its thread
    go = threading.Event()

    def put_share(k: int) -> None:
        go.wait(TIMEOUT)
        for seq in order[k::threads]:
            inbox.put(seq, rpc(seq))

    workers = [threading.Thread(target=put_share, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    go.set()
    for t in workers:
        t.join(TIMEOUT)
    inbox.put(n, None)
    assert [consumer.next() for _ in range(n + 1)] == [f"rpc-{i}" for i in range(n)] + [None]
    consumer.join()
