"""The result channel: never drops, never hides a sender's error, safe from many threads."""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import threading
import time
from collections import defaultdict
from typing import cast

import numpy as np
import pytest

import helpers.channel_children as children
from omni_async.core.errors import ProtocolError, UsageError
from omni_async.core.messages import AsyncDiffusionOutput, DiffusionOutput, OutputReady, RpcResult
from omni_async.transport.channel import (
    CREDIT_BYTES,
    InProcessChannel,
    PipeChannel,
    ResultChannel,
    dumps_message,
    loads_message,
)
from omni_async.transport.errors import ChannelClosed, ChannelFull, MessageTooLarge, UnpicklableMessage

SPAWN = multiprocessing.get_context("spawn")


def msg(i: int, payload: object = None) -> AsyncDiffusionOutput:
    return RpcResult(f"rpc-{i}", payload if payload is not None else i)


def rpc(m: AsyncDiffusionOutput | None) -> RpcResult:
    """A message received here: these tests send RPC_RESULTs (``msg``)."""
    assert isinstance(m, RpcResult), m
    return m


def both() -> list[ResultChannel]:
    return [InProcessChannel(maxsize=8), PipeChannel(capacity_bytes=8 * CREDIT_BYTES)]


@pytest.fixture(params=["inproc", "pipe"])
def channel(request: pytest.FixtureRequest) -> ResultChannel:
    ch: ResultChannel = (
        InProcessChannel(maxsize=4) if request.param == "inproc" else PipeChannel(capacity_bytes=4 * CREDIT_BYTES)
    )
    request.addfinalizer(ch.close)
    return ch


def test_round_trip_and_timeout(channel: ResultChannel) -> None:
    out = DiffusionOutput("req", {"x": [1, 2.5, "s"]}, async_output_id="o1")
    channel.put(OutputReady("o1", out, rank=3))
    got = channel.get(1.0)
    assert isinstance(got, OutputReady) and got.output == out and got.rank == 3
    t0 = time.monotonic()
    assert channel.get(0.05) is None
    assert time.monotonic() - t0 >= 0.04


def test_unpicklable_raises_at_the_sender_and_sends_nothing(channel: ResultChannel) -> None:
    with pytest.raises(UnpicklableMessage):
        channel.put(msg(1, payload=lambda: 0))
    with pytest.raises(UnpicklableMessage):
        channel.put(msg(2, payload=threading.Lock()))
    channel.put(msg(3))
    got = channel.get(1.0)
    assert got is not None and rpc(got).rpc_id == "rpc-3"
    assert channel.get(0.01) is None


def test_oversize_raises_at_the_sender(channel: ResultChannel) -> None:
    small = InProcessChannel(max_message_bytes=10_000, max_bytes=20_000)
    with pytest.raises(MessageTooLarge) as info:
        small.put(msg(1, payload=b"x" * 20_000))
    assert info.value.nbytes > 20_000 and info.value.limit == 10_000
    with pytest.raises(MessageTooLarge):
        channel.put(msg(1, payload=b"x" * (8 << 20)))


def test_wrong_type_is_a_usage_error(channel: ResultChannel) -> None:
    with pytest.raises(UsageError):
        channel.put("not a message")  # type: ignore[arg-type]


def test_full_channel_blocks_then_raises_and_never_drops(channel: ResultChannel) -> None:
    sent = 0
    with pytest.raises(ChannelFull):
        for i in range(100):
            channel.put(msg(i), timeout=0.05)
            sent += 1
    assert 1 <= sent < 100
    # Nothing was lost or reordered, and the failed put sent nothing.
    got = [channel.get(1.0) for _ in range(sent)]
    assert [rpc(g).rpc_id for g in got if g is not None] == [f"rpc-{i}" for i in range(sent)]
    assert channel.get(0.01) is None


def test_blocked_writer_resumes_when_the_reader_drains(channel: ResultChannel) -> None:
    n = 50
    done = threading.Event()

    def writer() -> None:
        for i in range(n):
            channel.put(msg(i), timeout=10.0)
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    got: list[object] = []
    while len(got) < n:
        m = channel.get(5.0)
        assert m is not None
        got.append(rpc(m).result)
    t.join(5.0)
    assert done.is_set() and got == list(range(n))


def test_close(channel: ResultChannel) -> None:
    channel.put(msg(1))
    channel.close()
    channel.close()  # idempotent
    with pytest.raises(ChannelClosed):
        channel.put(msg(2))
    with pytest.raises(ChannelClosed):
        channel.get(0.01)


def test_close_wakes_a_blocked_writer() -> None:
    ch = InProcessChannel(maxsize=1)
    ch.put(msg(0))
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            ch.put(msg(1), timeout=30.0)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.05)
    ch.close()
    t.join(5.0)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], ChannelClosed)


def test_undecodable_payload_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        loads_message(b"not a pickle")
    import pickle

    with pytest.raises(ProtocolError):
        loads_message(pickle.dumps({"kind": "rpc_result"}))
    assert rpc(loads_message(dumps_message(msg(7), None))).result == 7


def test_a_message_built_by_hand_is_a_protocol_error_at_the_receiver() -> None:
    """Unpickling skips the constructor: a peer's message its constructor would refuse
    must not reach the dispatcher (found by the fault matrix: an OUTPUT_READY carrying a
    dict for an awaited id left its waiter claimed forever and crashed the pump at
    shutdown; a kind outside the enum failed in the dispatcher untyped)."""
    import pickle

    def by_hand(m: AsyncDiffusionOutput, **fields: object) -> bytes:
        for name, value in fields.items():
            object.__setattr__(m, name, value)
        return pickle.dumps(m)

    bad = [
        by_hand(msg(1), kind="bogus"),
        by_hand(OutputReady("a", DiffusionOutput("r")), output={"image": 1}),
        by_hand(OutputReady("a", DiffusionOutput("r")), async_output_id=None),
        by_hand(msg(1), rank=-1),
    ]
    for data in bad:
        with pytest.raises(ProtocolError, match="invalid message"):
            loads_message(data)


def test_the_receiver_refuses_an_oversize_frame_and_reads_on() -> None:
    """M4: a frame above the message limit, written raw (no sender check, no credits), is
    refused at the receiver, typed, its bytes discarded; the next message arrives."""
    ch = PipeChannel(capacity_bytes=16 * CREDIT_BYTES, max_message_bytes=4 * CREDIT_BYTES)
    try:
        s = ch.new_sender("raw")
        huge = dumps_message(msg(1, b"x" * (8 * CREDIT_BYTES)), None)

        def write() -> None:
            s._conn.send_bytes(huge)
            s.put(msg(2))

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        with pytest.raises(ProtocolError, match=r"raw: a frame of \d+ bytes exceeds the limit"):
            ch.get(5.0)
        got = ch.get(5.0)
        assert got is not None and rpc(got).result == 2
        writer.join(5)
        assert s._credits.get_value() == 16 and ch.senders == ["raw"]
    finally:
        ch.close()


def test_raw_writes_do_not_inflate_the_credit_budget() -> None:
    """M4: frames a writer sent without taking credits give none back beyond the budget."""
    ch = PipeChannel(capacity_bytes=4 * CREDIT_BYTES)
    try:
        s = ch.new_sender("raw")
        for i in range(10):
            s._conn.send_bytes(dumps_message(msg(i), None))
        got = [ch.get(2.0) for _ in range(10)]
        assert [rpc(m).result for m in got if m is not None] == list(range(10))
        assert s._credits.get_value() == 4
    finally:
        ch.close()


def test_a_torn_frame_holds_only_its_own_sender() -> None:
    """M5: a sender stopped half-way through a frame does not block the reader; it shows in
    ``torn_senders``, and the frame is whole once the rest comes."""
    ch = PipeChannel(capacity_bytes=4 * CREDIT_BYTES)
    try:
        a, b = ch.new_sender("a"), ch.new_sender("b")
        frame = dumps_message(msg(4), None)
        head = struct.pack("!i", len(frame)) + frame[:10]
        os.write(a._conn.fileno(), head)
        b.put(msg(3))
        got = ch.get(2.0)
        assert got is not None and rpc(got).result == 3
        assert ch.get(0.1) is None
        assert list(ch.torn_senders(0.0)) == ["a"] and ch.torn_senders(60.0) == {}
        os.write(a._conn.fileno(), frame[10:])
        got = ch.get(2.0)
        assert got is not None and rpc(got).result == 4
        assert ch.torn_senders(0.0) == {}
    finally:
        ch.close()


def test_many_threads_one_process_inproc() -> None:
    ch = InProcessChannel(maxsize=16)
    threads, per = 8, 200

    def run(tid: int) -> None:
        for i in range(per):
            ch.put(msg(i, payload=(tid, i)), timeout=10.0)

    ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    seen: dict[int, list[int]] = defaultdict(list)
    for _ in range(threads * per):
        m = ch.get(10.0)
        assert m is not None
        tid, i = cast(tuple[int, int], rpc(m).result)
        seen[tid].append(i)
    for t in ts:
        t.join()
    assert {t: v for t, v in seen.items()} == {t: list(range(per)) for t in range(threads)}


@pytest.mark.slow
def test_four_threads_of_a_child_process_lose_nothing() -> None:
    """F7 across a real process boundary: 4 threads x 300 messages, a small byte budget."""
    ch = PipeChannel(capacity_bytes=4 * CREDIT_BYTES, mp_context=SPAWN)
    sender = ch.new_sender("worker-0")
    threads, per = 4, 300
    p = SPAWN.Process(target=children.write_from_threads, args=(sender, threads, per), name="omni-test-writer")
    p.start()
    sender.close()  # the child holds its own copy; EOF then means the child is done
    seen: dict[str, list[int]] = defaultdict(list)
    deadline = time.monotonic() + 60
    while sum(map(len, seen.values())) < threads * per and time.monotonic() < deadline:
        m = ch.get(1.0)
        if m is not None:
            seen[rpc(m).rpc_id or ""].append(cast(tuple[str, int], rpc(m).result)[1])
    p.join(30)
    assert p.exitcode == 0
    assert sorted(seen) == [f"t{t}" for t in range(threads)]
    for ids in seen.values():
        assert ids == list(range(per))  # per-thread order kept, nothing lost or duplicated
    assert ch.get(0.2) is None and ch.senders == []  # EOF noticed, sender dropped
    ch.close()


@pytest.mark.slow
def test_a_sender_is_reported_gone_only_after_its_last_messages_were_read() -> None:
    """``on_sender_gone`` is how the executor knows a dead worker's every message was
    handled (before it reclaims what the worker shipped and never sent): it must not
    run while frames read from that pipe are still queued.  Here one read takes two
    whole frames and a header that ends the pipe (negative length)."""
    gone: list[str] = []
    ch = PipeChannel(mp_context=SPAWN, on_sender_gone=gone.append)
    sender = ch.new_sender("corrupt")
    p = SPAWN.Process(target=children.write_then_corrupt, args=(sender, 2))
    p.start()
    sender.close()
    p.join(30)
    assert p.exitcode == 0
    try:
        for i in range(2):
            m = ch.get(20.0)
            assert m is not None and rpc(m).result == i
            assert gone == [], f"reported gone with message {i + 1} of 2 still to be read"
        with pytest.raises(ProtocolError, match="negative length"):
            ch.get(1.0)
        assert gone == []
        assert ch.get(0.5) is None
        assert gone == ["corrupt"] and ch.senders == []
    finally:
        ch.close()


@pytest.mark.slow
def test_a_killed_writer_is_dropped_not_fatal() -> None:
    gone: list[str] = []
    ch = PipeChannel(mp_context=SPAWN, on_sender_gone=gone.append)
    sender = ch.new_sender("doomed")
    p = SPAWN.Process(target=children.write_then_hang, args=(sender, 5))
    p.start()
    sender.close()
    got: list[object] = []
    while len(got) < 5:
        m = ch.get(20.0)
        assert m is not None
        got.append(rpc(m).result)
    assert got == list(range(5))
    assert p.pid is not None
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert ch.get(2.0) is None
    assert gone == ["doomed"]
    ch.put(msg(9))  # the channel still works for everyone else
    m = ch.get(1.0)
    assert m is not None and rpc(m).result == 9
    ch.close()


def test_sender_of_a_closed_channel_raises() -> None:
    ch = PipeChannel()
    sender = ch.new_sender()
    ch.close()
    with pytest.raises(ChannelClosed):
        sender.put(msg(1), timeout=1.0)
    sender.close()
    with pytest.raises(ChannelClosed):
        ch.new_sender()


def test_construction_checks() -> None:
    with pytest.raises(UsageError):
        InProcessChannel(maxsize=0)
    with pytest.raises(UsageError):
        InProcessChannel(max_bytes=10, max_message_bytes=20)
    with pytest.raises(UsageError):
        PipeChannel(capacity_bytes=CREDIT_BYTES, max_message_bytes=2 * CREDIT_BYTES)
    with pytest.raises(UsageError):
        InProcessChannel().put(msg(1), timeout=-1)


def test_unserialized_inproc_passes_objects() -> None:
    ch = InProcessChannel(serialize=False)
    m = msg(1, payload=lambda: 0)  # not picklable, fine without serialization
    ch.put(m)
    assert ch.get(1.0) is m
    assert isinstance(both()[0], ResultChannel)


def _big_payload(tid: int, i: int, n: int) -> bytes:
    """``n`` bytes that differ at every offset between (thread, message) pairs."""
    k = np.arange(n, dtype=np.uint32)
    return ((k * (2 * tid + 1) + 97 * i + (k >> 8)) & 0xFF).astype(np.uint8).tobytes()


def test_large_messages_from_many_threads_arrive_intact_f7() -> None:
    """F7 with messages that cannot be written atomically.

    Small messages go out in one ``write`` (at most PIPE_BUF bytes are atomic anyway),
    so they survive two writers even without the sender's lock.  These carry 384 KiB
    inline: each is a header write plus a body write far above PIPE_BUF and a large
    part of the pipe's buffer, so without the lock two threads interleave them and the
    reader sees torn or mixed frames.  Every message must arrive whole, its bytes its
    own, in each thread's order.
    """
    ch = PipeChannel(mp_context=SPAWN)  # 8 MiB of credits: room for every writer at once
    sender = ch.new_sender("big")
    threads, per, nbytes = 4, 6, 384 << 10
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def write(tid: int) -> None:
        try:
            start.wait(10.0)
            for i in range(per):
                sender.put(RpcResult(f"t{tid}", (tid, i, _big_payload(tid, i, nbytes))), timeout=20.0)
        except BaseException as exc:
            errors.append(exc)

    got: list[tuple[int, int, bytes]] = []
    read_errors: list[BaseException] = []

    def read() -> None:
        # A reader thread of its own: a torn frame can make recv_bytes wait for bytes
        # that never come, and the test must fail, not hang (EOF ends it below).
        try:
            while len(got) < threads * per:
                m = ch.get(20.0)
                if m is None:
                    return
                got.append(cast(tuple[int, int, bytes], rpc(m).result))
        except BaseException as exc:
            read_errors.append(exc)

    reader = threading.Thread(target=read, name="big-reader", daemon=True)
    reader.start()
    writers = [threading.Thread(target=write, args=(t,), name=f"big-writer-{t}", daemon=True) for t in range(threads)]
    for t in writers:
        t.start()
    reader.join(30.0)
    # However the reader ended: closing the reading end frees a writer blocked on a
    # full pipe (EPIPE), closing the writing end gives a reader stuck in a torn frame EOF.
    ch.close()
    for t in writers:
        t.join(10.0)
    sender.close()
    reader.join(10.0)
    assert not read_errors, read_errors
    assert not errors, errors
    assert len(got) == threads * per, f"{len(got)} of {threads * per} messages arrived"
    order: dict[int, list[int]] = defaultdict(list)
    for tid, i, data in got:
        assert data == _big_payload(tid, i, nbytes), f"message {i} of thread {tid} arrived with foreign bytes"
        order[tid].append(i)
    assert order == {t: list(range(per)) for t in range(threads)}
