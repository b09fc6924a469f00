"""``OutputRegistry.claim``: exactly one taker per output, decided by the registry from the
id's record while it lives and from its memory of finished ids after (the executor's
4,096-entry claim table is gone)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from omni_async.core.errors import ExecutorShutdown, OutputAlreadyClaimed, OutputDropped, OutputError, RemoteError
from omni_async.core.messages import DiffusionOutput, Failure
from omni_async.core.registry import OutputRegistry, apply_resolutions


def _registry(**kw: Any) -> OutputRegistry:
    return OutputRegistry(**kw)


def _announce(reg: OutputRegistry, oid: str) -> None:
    reg.on_compute_done([oid], now=0.0, request_ids=[f"r-{oid}"])


def _refusal(fut: Future[DiffusionOutput]) -> str:
    assert fut.done()
    err = fut.exception(0)
    assert isinstance(err, OutputAlreadyClaimed), err
    return str(err)


def test_a_second_claim_while_the_first_waits_is_refused_and_names_it() -> None:
    reg = _registry()
    _announce(reg, "a")
    first = reg.claim("a")
    assert not first.done()
    assert "(waiting)" in _refusal(reg.claim("a"))
    assert reg.wait("a") is first, "wait, the seed's shape, still shares the one waiter"


def test_the_outcome_of_the_first_claim_is_remembered_after_the_record_is_gone() -> None:
    reg = _registry()
    for oid in ("ok", "bad", "gone"):
        _announce(reg, oid)
    ok, bad, gone = reg.claim("ok"), reg.claim("bad"), reg.claim("gone")
    reg.on_output("ok", output=DiffusionOutput("r-ok", 1))
    reg.on_output("bad", failure=Failure("ValueError", "no", ""))
    assert gone.cancel()
    reg.cancel("gone", gone)
    reg.on_output("gone", output=DiffusionOutput("r-gone", 2))
    apply_resolutions(reg.take_resolutions())
    assert ok.result(0).output == 1 and isinstance(bad.exception(0), RemoteError)
    assert len(reg) == 0
    assert "(delivered)" in _refusal(reg.claim("ok"))
    assert "(failed with RemoteError)" in _refusal(reg.claim("bad"))
    assert "(cancelled)" in _refusal(reg.claim("gone"))


def test_a_claim_that_fails_at_once_claims_nothing() -> None:
    reg = _registry()
    unknown = reg.claim("never")
    assert isinstance(unknown.exception(0), OutputError) and not isinstance(unknown.exception(0), OutputAlreadyClaimed)
    assert not isinstance(reg.claim("never").exception(0), OutputAlreadyClaimed)
    _announce(reg, "d")
    reg.drop("d")
    assert isinstance(reg.claim("d").exception(0), OutputDropped)
    assert isinstance(reg.claim("d").exception(0), OutputDropped), "a refused claim is no claim"


def test_a_dropped_claim_says_failed_and_a_closed_registry_says_it_is_closed() -> None:
    reg = _registry()
    _announce(reg, "x")
    waiter = reg.claim("x")
    reg.drop("x")
    apply_resolutions(reg.take_resolutions())
    assert isinstance(waiter.exception(0), OutputDropped)
    reg.on_output("x", output=DiffusionOutput("r-x", 0))  # the drop's OUTPUT_READY: gone now
    assert "(failed with OutputDropped)" in _refusal(reg.claim("x"))
    _announce(reg, "y")
    reg.claim("y")
    reg.fail_all(lambda oid: ExecutorShutdown("closed", output_id=oid), outcome="shutdown", close=True)
    apply_resolutions(reg.take_resolutions())
    assert isinstance(reg.claim("y").exception(0), ExecutorShutdown), "the closed registry's error says more"


def test_the_memory_of_finished_claims_is_bounded() -> None:
    reg = _registry(max_finished=2)
    for oid in ("p", "q", "r"):
        _announce(reg, oid)
        reg.claim(oid)
        reg.on_output(oid, output=DiffusionOutput(f"r-{oid}", 0))
    apply_resolutions(reg.take_resolutions())
    assert not isinstance(reg.claim("p").exception(0), OutputAlreadyClaimed), "forgotten: unknown again"
    assert "(delivered)" in _refusal(reg.claim("r"))
