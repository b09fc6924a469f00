"""Random protocol runs of the sans-IO core (``Dispatcher`` + ``OutputRegistry``), as traces.

``drive(rng)`` plays workers and an engine against the real dispatcher and registry,
the way the pump would (one call at a time, futures resolved after each call), and
returns the recorded trace.  The workers behave like ``WorkerLoop`` and ``Packer``:
one FIFO per (rank, thread), the reply rank's packer may answer before its main
thread (early arrival); the harness adds what a real run rarely shows: duplicate
messages, a COMPUTE_DONE naming another call's id, a COMPUTE_DONE that could not be sent
(the failure that replaces it names the ids: ``compute_failed``), a cancelled waiter whose done-callback runs late (the F3 race), timeouts,
a call the engine cancels before it resolves, a consumer that goes away (through the dispatcher, which also
fails its pending calls, or the registry alone), a broadcast that fails part-way, a worker death, messages that reach a closed registry.

Used by tests/verify/test_trace_validation.py; every trace ends with a shutdown.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import Future

from omni_async.core.dispatch import Dispatcher
from omni_async.core.errors import ExecutorShutdown, WorkerDied
from omni_async.core.messages import (
    AsyncDiffusionOutput,
    ComputeDone,
    DiffusionOutput,
    Failure,
    OutputReady,
    RpcResult,
    RunnerOutput,
)
from omni_async.core.registry import OutputRegistry, apply_resolutions
from omni_async.core.trace import TraceEvent
from omni_async.verify.recorder import ListTracer

M = AsyncDiffusionOutput


class _Run:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.tracer = ListTracer()
        self.reg = OutputRegistry(output_timeout=rng.choice([None, 5.0]), tracer=self.tracer)
        self.world = rng.choice([1, 2, 2, 3])
        self.disp = Dispatcher(
            self.reg, world_size=self.world, reply_rank=0, compute_timeout=rng.choice([None, 8.0]), tracer=self.tracer
        )
        self.now = 0.0
        self.chans: dict[tuple[int, str], deque[M]] = {
            (r, w): deque() for r in range(self.world) for w in ("main", "packer")
        }
        self.delivered: list[M] = []
        self.rpc_futs: dict[str, Future[tuple[RunnerOutput, ...]]] = {}
        self.known: list[str] = []
        self.waiters: dict[str, Future[DiffusionOutput]] = {}
        self.late_callbacks: list[tuple[str, Future[DiffusionOutput]]] = []
        self.rpcs = 0
        self.ids = 0
        self.dead = False
        self.unsent: list[str] = []  # broadcasts that failed part-way, not yet forgotten

    def settle(self) -> None:
        apply_resolutions(self.disp.take_resolutions())
        for rid, f in list(self.rpc_futs.items()):
            if f.done():
                del self.rpc_futs[rid]
                if not f.cancelled() and f.exception() is None:
                    self.known.extend(ro.async_output_id for ro in f.result() if ro.async_output_id)

    def submit(self) -> None:
        rng = self.rng
        self.rpcs += 1
        rid = f"rpc{self.rpcs}"
        oids = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            self.ids += 1
            oids.append(f"out{self.ids}")
        self.rpc_futs[rid] = self.disp.submit(
            rid, "execute_model_batch", now=self.now, consumer=rng.choice([None, "c"])
        )
        reached = self.world
        if rng.random() < 0.06:
            # The broadcast fails at rank ``reached``: the ranks before it got the call
            # and answer; the executor forgets the call soon (while the pump runs on).
            reached = rng.randrange(self.world)
            self.unsent.append(rid)
            if reached == 0:
                return
        if rng.random() < 0.1:
            self.chans[(0, "main")].append(RpcResult.failed(rid, Failure("RuntimeError", "forward failed"), rank=0))
        else:
            for oid in oids:
                if rng.random() < 0.15:
                    self.chans[(0, "packer")].append(OutputReady.failed(oid, Failure("PackError", "cannot pack")))
                else:
                    self.chans[(0, "packer")].append(OutputReady(oid, DiffusionOutput(f"req-{oid}")))
            named = list(oids)
            if self.ids > len(oids) and rng.random() < 0.05:
                named.append(f"out{rng.randint(1, self.ids - len(oids))}")  # another call's id: refused
            if rng.random() < 0.08:
                # The COMPUTE_DONE put raised after the packer got the outputs (defect 3).
                failure = Failure("ChannelFull", "cannot send COMPUTE_DONE")
                self.chans[(0, "main")].append(RpcResult.compute_failed(rid, tuple(named), failure, rank=0))
            else:
                self.chans[(0, "main")].append(ComputeDone(rid, tuple(named), tuple(f"req-{o}" for o in named)))
        for r in range(1, reached):
            if rng.random() < 0.1:
                self.chans[(r, "main")].append(RpcResult.failed(rid, Failure("RuntimeError", "rank failed"), rank=r))
            else:
                self.chans[(r, "main")].append(RpcResult(rid, None, rank=r))

    def handle(self, msg: M) -> None:
        self.disp.handle(msg, now=self.now)
        self.disp.expire(self.now)

    def forget(self, rid: str) -> None:
        self.unsent.remove(rid)
        self.disp.forget(rid, ExecutorShutdown(f"cannot send {rid} to every worker"))

    def step(self) -> None:
        rng, reg = self.rng, self.reg
        if self.unsent and rng.random() < 0.4:
            self.forget(rng.choice(self.unsent))
            self.settle()
            return
        c = rng.random()
        live = [k for k, q in self.chans.items() if q]
        if c < 0.12:
            if not self.dead:
                self.submit()
        elif c < 0.46:
            if live:
                msg = self.chans[rng.choice(live)].popleft()
                self.delivered.append(msg)
                self.handle(msg)
        elif c < 0.48:
            if self.delivered:
                self.handle(rng.choice(self.delivered))  # a duplicate
        elif c < 0.66:
            fresh = [o for o in self.known if o not in self.waiters]
            if fresh:
                oid = rng.choice(fresh)
                self.waiters[oid] = reg.wait(oid)
        elif c < 0.72:
            pending = [o for o, f in self.waiters.items() if not f.done()]
            if pending:
                oid = rng.choice(pending)
                fut = self.waiters[oid]
                if fut.cancel():
                    if rng.random() < 0.5:
                        reg.cancel(oid, fut)  # the done-callback, at once
                    else:
                        self.late_callbacks.append((oid, fut))  # ... or after the pump's claim (F3)
        elif c < 0.75:
            if self.late_callbacks:
                oid, fut = self.late_callbacks.pop(rng.randrange(len(self.late_callbacks)))
                reg.cancel(oid, fut)
        elif c < 0.80:
            if self.known:
                reg.drop(rng.choice(self.known))
        elif c < 0.95:
            self.now += rng.uniform(0.0, 4.0)
            self.disp.expire(self.now)
        elif c < 0.96:
            if rng.random() < 0.5:
                self.disp.release_consumer("c")
            else:
                reg.release_consumer("c")
        elif c < 0.97:
            if self.rpc_futs:
                self.rpc_futs[rng.choice(sorted(self.rpc_futs))].cancel()  # the engine cancels a call
        elif not self.dead and rng.random() < 0.3:
            self.dead = True
            self.disp.fail_all(lambda oid: WorkerDied(1, -9, output_id=oid), outcome="worker_died")
        self.settle()

    def finish(self) -> list[TraceEvent]:
        while self.unsent:
            self.forget(self.unsent[0])
        for oid, fut in self.late_callbacks:
            self.reg.cancel(oid, fut)
        self.disp.fail_all(lambda oid: ExecutorShutdown("shut down", output_id=oid), outcome="shutdown", close=True)
        self.settle()
        for q in self.chans.values():  # what was still in flight reaches a closed registry
            while q:
                msg = q.popleft()
                if self.rng.random() < 0.5:
                    self.handle(msg)
        self.settle()
        return self.tracer.snapshot()


def drive(rng: random.Random, steps: int = 50) -> list[TraceEvent]:
    run = _Run(rng)
    for _ in range(steps):
        run.step()
    return run.finish()


def coverage(traces: Sequence[Sequence[TraceEvent]]) -> Counter[str]:
    """How many traces show each situation the validation must cover."""
    seen: Counter[str] = Counter()
    for t in traces:
        tags: set[str] = set()
        expiring = False
        for n, e in enumerate(t):
            f = e.fields
            if e.action == "WaiterResolve" and f.get("outcome") == "cancelled" and n + 1 < len(t):
                nxt = t[n + 1]
                if nxt.action == "Fire" and nxt.fields.get("src") in ("READY", "FAILED"):
                    tags.add("claim race")
            if e.action == "Fire" and f.get("dst") in ("EARLY_READY", "EARLY_FAILED"):
                tags.add("early arrival")
            if e.action == "PumpRecv" and f.get("kind") == "RPC_RESULT" and f.get("ids"):
                tags.add("compute failed")
            if e.action == "Expire":
                expiring = True
            elif e.action in ("PumpRecv", "Drop", "Cancel", "WaiterAdd", "FailAll", "ReleaseConsumer", "RpcSubmit"):
                expiring = False
            if expiring and e.action == "Fire" and f.get("event") == "FORCE_RELEASE":
                tags.add("early output orphaned")
            if e.action == "Fire" and f.get("event") == "DROP":
                tags.add("drop")
            if e.action == "Fire" and f.get("event") == "OUTPUT_FAILED":
                tags.add("output failure")
            if e.action == "RpcResolve" and f.get("outcome") == "failed":
                tags.add("rpc failure")
            if e.action == "WaiterResolve":
                tags.add(f"waiter {f.get('outcome')}")
            if e.action == "RpcResolve" and f.get("outcome") == "timeout":
                tags.add("rpc timeout")
            if e.action == "RpcResolve" and f.get("outcome") == "unsent":
                tags.add("rpc unsent")
            if e.action == "ProtocolError":
                tags.add("duplicate")
            if e.action == "Fire" and f.get("event") == "FORCE_RELEASE":
                tags.add("force release")
            if e.action == "Late":
                tags.add("late expected" if f.get("expected") else "late refused")
            if e.action == "DispatchDrop":
                tags.add(f"dispatcher drop {f.get('reason')}")
            if e.action == "RpcResolve" and f.get("outcome") == "consumer_gone":
                tags.add("consumer gone")
            if e.action == "Expire":
                tags.add("expire")
        if any(e.action == "WaiterResolve" and e.fields.get("outcome") == "worker_died" for e in t) or any(
            e.action == "RpcResolve" and e.fields.get("outcome") == "worker_died" for e in t
        ):
            tags.add("worker death")
        seen.update(tags)
    return seen
