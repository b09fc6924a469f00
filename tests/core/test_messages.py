"""Protocol messages validate themselves on construction and survive pickling."""

from __future__ import annotations

import pickle
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_async.core.errors import MessageValidationError, RemoteError, RpcFailed
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    AsyncOutputKind,
    BatchDiffusionOutput,
    ComputeDone,
    DiffusionOutput,
    DiffusionRequest,
    Failure,
    OutputReady,
    RpcRequest,
    RpcResult,
    RunnerOutput,
    check_wire_message,
)

K = AsyncOutputKind


def _out(rid: str = "req-0", oid: str | None = None) -> DiffusionOutput:
    return DiffusionOutput(request_id=rid, output={"image": [1, 2, 3]}, async_output_id=oid, metrics={"t": 0.5})


# --------------------------------------------------------------------------- invalid


@pytest.mark.parametrize(
    ("label", "build"),
    [
        ("compute_done without ids", lambda: ComputeDone("rpc", (), ())),
        ("compute_done without rpc_id", lambda: ComputeDone(None, ("a",), ("r",))),  # type: ignore[arg-type]
        ("compute_done empty id", lambda: ComputeDone("rpc", ("",), ("r",))),
        ("compute_done duplicate ids", lambda: ComputeDone("rpc", ("a", "a"), ("r1", "r2"))),
        ("compute_done fewer request ids", lambda: ComputeDone("rpc", ("a", "b"), ("r1",))),
        ("compute_done more request ids", lambda: ComputeDone("rpc", ("a",), ("r1", "r2"))),
        ("output_ready with neither", lambda: OutputReady("a")),
        ("output_ready with both", lambda: OutputReady("a", _out(), failure=Failure("E", "m"))),
        ("output_ready without id", lambda: OutputReady(None, _out())),  # type: ignore[arg-type]
        ("output_ready empty id", lambda: OutputReady("", _out())),
        ("output_ready for another id", lambda: OutputReady("a", _out(oid="b"))),
        ("output_ready carrying no DiffusionOutput", lambda: OutputReady("a", {"x": 1})),  # type: ignore[arg-type]
        ("output_ready failure not a Failure", lambda: OutputReady("a", failure="boom")),  # type: ignore[arg-type]
        ("rpc_result without rpc_id", lambda: RpcResult(None, 1)),  # type: ignore[arg-type]
        ("rpc_result with result and failure", lambda: RpcResult("r", 1, failure=Failure("E", "m"))),
        ("rpc_result with ids but no failure", lambda: RpcResult("r", async_output_ids=("a",))),
        ("compute_failed naming an id twice", lambda: RpcResult.compute_failed("r", ("a", "a"), Failure("E", "m"))),
        ("compute_failed with an empty id", lambda: RpcResult.compute_failed("r", ("",), Failure("E", "m"))),
        ("negative rank", lambda: RpcResult("r", None, rank=-1)),
        ("rank not an int", lambda: RpcResult("r", rank="0")),  # type: ignore[arg-type]
        ("empty batch", lambda: BatchDiffusionOutput(())),
        ("batch with a request twice", lambda: BatchDiffusionOutput((_out("x"), _out("x")))),
        ("runner output with result and id", lambda: RunnerOutput("r", result=_out(), async_output_id="a")),
        ("request without id", lambda: DiffusionRequest("")),
        ("rpc request without id", lambda: RpcRequest("", "execute_model")),
        ("rpc request without method", lambda: RpcRequest("rpc", "")),
    ],
)
def test_invalid_message_raises(label: str, build: Any) -> None:
    with pytest.raises(MessageValidationError):
        build()


# A field of another kind is no field of this kind's class: the constructor refuses it
# (these were value checks of the one envelope class; now no such message can exist).
@pytest.mark.parametrize(
    ("label", "build"),
    [
        ("compute_done with an output", lambda: ComputeDone("rpc", ("a",), ("r",), output=_out())),  # type: ignore[call-arg]
        ("compute_done with async_output_id", lambda: ComputeDone("rpc", ("a",), ("r",), async_output_id="a")),  # type: ignore[call-arg]
        ("compute_done with a failure", lambda: ComputeDone("rpc", ("a",), ("r",), failure=Failure("E", "m"))),  # type: ignore[call-arg]
        ("compute_done with a result", lambda: ComputeDone("rpc", ("a",), ("r",), result=1)),  # type: ignore[call-arg]
        ("output_ready with async_output_ids", lambda: OutputReady("a", _out(), async_output_ids=("a",))),  # type: ignore[call-arg]
        ("output_ready with request_ids", lambda: OutputReady("a", _out(), request_ids=("r",))),  # type: ignore[call-arg]
        ("output_ready with a result", lambda: OutputReady("a", _out(), result=3)),  # type: ignore[call-arg]
        (
            "rpc_result with request ids",
            lambda: RpcResult("r", async_output_ids=("a",), request_ids=("q",), failure=Failure("E", "m")),  # type: ignore[call-arg]
        ),
        ("rpc_result with an output id", lambda: RpcResult("r", async_output_id="a")),  # type: ignore[call-arg]
        ("rpc_result with an output", lambda: RpcResult("r", output=_out())),  # type: ignore[call-arg]
        ("a kind given", lambda: RpcResult("r", kind=K.COMPUTE_DONE)),  # type: ignore[call-arg]
    ],
)
def test_a_field_of_another_kind_is_refused(label: str, build: Any) -> None:
    with pytest.raises(TypeError):
        build()


def test_a_kind_set_by_hand_is_refused_on_read() -> None:
    """A peer that sets ``kind`` by hand (unpickling skips the constructor) is refused by
    the channel's read validation (``check_wire_message``)."""
    for kind in ("compute_done", K.CHUNK):
        msg = RpcResult("r", 1)
        object.__setattr__(msg, "kind", kind)
        with pytest.raises(MessageValidationError, match="kind"):
            check_wire_message(msg)
    assert check_wire_message(RpcResult("r", 1)) == RpcResult("r", 1)


def test_validation_error_is_a_usage_error_and_value_error() -> None:
    from omni_async.core.errors import UsageError

    with pytest.raises(UsageError):
        ComputeDone("rpc", (), ())
    with pytest.raises(ValueError):
        ComputeDone("rpc", (), ())


def test_evolve_revalidates() -> None:
    msg = ComputeDone("rpc", ("a",), ("r",))
    with pytest.raises(MessageValidationError):
        attrs.evolve(msg, async_output_ids=())


# --------------------------------------------------------------------------- valid

_ids = st.text(alphabet="abcdefgh0123456789-", min_size=1, max_size=12)


@st.composite
def valid_messages(draw: st.DrawFn) -> AsyncDiffusionOutput:
    kind = draw(st.sampled_from(list(K)))
    rank = draw(st.integers(0, 7))
    if kind is K.COMPUTE_DONE:
        oids = draw(st.lists(_ids, min_size=1, max_size=5, unique=True))
        rids = draw(st.lists(_ids, min_size=len(oids), max_size=len(oids)))
        return ComputeDone(draw(_ids), tuple(oids), tuple(rids), rank=rank)
    if kind is K.OUTPUT_READY:
        oid = draw(_ids)
        if draw(st.booleans()):
            out = DiffusionOutput(
                request_id=draw(_ids),
                output=draw(st.recursive(st.integers() | st.text(max_size=5), lambda c: st.lists(c, max_size=3))),
                async_output_id=draw(st.sampled_from([None, oid])),
                metrics=draw(st.dictionaries(_ids, st.floats(allow_nan=False), max_size=3)),
            )
            return OutputReady(oid, out, rank=rank)
        return OutputReady.failed(oid, Failure(draw(_ids), draw(st.text(max_size=20)), "tb"), rank=rank)
    if draw(st.booleans()):
        return RpcResult(draw(_ids), draw(st.none() | st.integers() | st.text(max_size=8)), rank=rank)
    return RpcResult.failed(draw(_ids), Failure("ValueError", "boom"), rank=rank)


@given(valid_messages())
def test_valid_messages_pickle_round_trip(msg: AsyncDiffusionOutput) -> None:
    back = pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == msg
    assert type(back) is type(msg)
    assert back.kind is msg.kind


def test_named_constructors_set_the_fields() -> None:
    cd = ComputeDone("rpc-1", ("o1", "o2"), ("r1", "r2"), rank=2)
    assert (cd.kind, cd.rank, cd.rpc_id, cd.async_output_ids, cd.request_ids) == (
        K.COMPUTE_DONE,
        2,
        "rpc-1",
        ("o1", "o2"),
        ("r1", "r2"),
    )
    ready = OutputReady("o1", _out(oid="o1"))
    assert ready.output is not None and ready.failure is None and ready.async_output_id == "o1"
    failed = OutputReady.failed("o1", Failure("E", "m"))
    assert failed.kind is K.OUTPUT_READY and failed.output is None and failed.failure == Failure("E", "m")
    res = RpcResult("rpc-2", {"x": 1}, rank=1)
    assert res.result == {"x": 1} and res.failure is None and not res.names_outputs
    # The failure that replaces a COMPUTE_DONE that could not be sent (defect 3).
    cf = RpcResult.compute_failed("rpc-3", ("o1", "o2"), Failure("E", "m"), rank=1)
    assert (cf.kind, cf.rank, cf.async_output_ids, cf.failure) == (
        K.RPC_RESULT,
        1,
        ("o1", "o2"),
        Failure("E", "m"),
    )
    assert not hasattr(cf, "request_ids")
    assert cf.names_outputs and cd.names_outputs
    # An output that names no id yet is accepted (the packer fills it in).
    assert OutputReady("o9", _out(oid=None)).output is not None


def test_messages_are_frozen() -> None:
    msg = RpcResult("rpc", 1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        msg.rank = 3  # type: ignore[misc]


def test_kinds_repr_as_names() -> None:
    assert repr(K.COMPUTE_DONE) == "COMPUTE_DONE"


# --------------------------------------------------------------------------- failures


class _NestedBoom(RuntimeError):
    pass


def _raise_deep() -> None:
    def inner() -> None:
        raise _NestedBoom("the pack went wrong: 42")

    inner()


def test_failure_from_exception_keeps_type_message_and_traceback() -> None:
    try:
        _raise_deep()
    except _NestedBoom as exc:
        f = Failure.from_exception(exc)
    assert f.type_name == "_NestedBoom"
    assert f.message == "the pack went wrong: 42"
    assert "_raise_deep" in f.traceback and "inner" in f.traceback
    assert "_NestedBoom: the pack went wrong: 42" in f.traceback
    # It pickles as plain strings (the exception class is not needed on the other side).
    assert pickle.loads(pickle.dumps(f)) == f


def test_rpc_error_answers_with_the_exception_as_a_typed_failure() -> None:
    try:
        _raise_deep()
    except _NestedBoom as exc:
        msg = RpcResult.error("rpc-3", exc, rank=2)
        assert msg == RpcResult.failed("rpc-3", Failure.from_exception(exc), rank=2)
    assert (msg.kind, msg.rank, msg.rpc_id, msg.result) == (K.RPC_RESULT, 2, "rpc-3", None)
    assert msg.failure is not None and msg.failure.type_name == "_NestedBoom" and "inner" in msg.failure.traceback
    assert RpcResult.error("rpc-4", KeyError("k")).failure == Failure.from_exception(KeyError("k"))


def test_failure_from_unraised_exception() -> None:
    f = Failure.from_exception(KeyError("k"))
    assert f.type_name == "KeyError"
    assert f.message == "'k'"
    assert "KeyError" in f.traceback


def test_failure_with_chained_cause_keeps_both() -> None:
    try:
        try:
            raise OSError("disk")
        except OSError as inner:
            raise ValueError("outer") from inner
    except ValueError as exc:
        f = Failure.from_exception(exc)
    assert "OSError: disk" in f.traceback and "ValueError: outer" in f.traceback


def test_remote_error_carries_the_typed_failure() -> None:
    f = Failure("CudaError", "illegal address", "Traceback ...\n  frame\n")
    err = RemoteError(f, output_id="o1", rank=3)
    assert err.failure is f and err.output_id == "o1" and err.rank == 3
    text = str(err)
    assert "CudaError: illegal address" in text and "o1" in text and "rank 3" in text and "frame" in text


def test_rpc_failed_names_every_rank() -> None:
    err = RpcFailed("rpc-7", "execute_model", {2: Failure("A", "a"), 0: Failure("B", "b")})
    text = str(err)
    assert "[0, 2]" in text and "rank 0: B: b" in text and "rank 2: A: a" in text
    assert err.failures.keys() == {0, 2}


# --------------------------------------------------------------------------- batches


def test_batch_per_request_yields_each_output_in_order() -> None:
    outs = tuple(_out(f"r{i}") for i in range(4))
    batch = BatchDiffusionOutput(outs)
    got = list(batch.per_request())
    assert got == list(outs)
    assert [o.request_id for o in got] == ["r0", "r1", "r2", "r3"]
    assert pickle.loads(pickle.dumps(batch)) == batch


def test_requests_and_runner_outputs() -> None:
    req = DiffusionRequest("r1", {"steps": 4})
    assert pickle.loads(pickle.dumps(req)) == req
    ro = RunnerOutput("r1", async_output_id="o1")
    assert ro.finished and ro.result is None
    rpc = RpcRequest("rpc", "execute_model", (req,), {"k": 1}, async_output=True)
    assert pickle.loads(pickle.dumps(rpc)) == rpc


def test_output_ready_must_not_name_an_rpc() -> None:
    with pytest.raises(TypeError, match="rpc_id"):
        OutputReady("o1", DiffusionOutput("q"), rpc_id="r1")  # type: ignore[call-arg]


def test_rank_must_be_an_int_not_a_bool() -> None:
    with pytest.raises(MessageValidationError, match="rank"):
        RpcResult("r1", None, rank=True)
