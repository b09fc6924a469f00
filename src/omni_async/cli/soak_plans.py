"""The soak's plans and its accounting: what each request does (a function of
``(seed, index)``: sizes, steps, and at most one fault), and the one outcome each
request ends with (``Accounting``, ``classify``)."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Mapping

import attrs

from omni_async.core.errors import OmniAsyncError, RemoteError, RpcFailed
from omni_async.core.messages import DiffusionRequest

__all__ = [
    "ABORTED",
    "CANCELLED",
    "CHANGED",
    "CONSUMER_GONE",
    "ENGINE_FAULTS",
    "FAULTS",
    "INLINE_HEIGHTS",
    "RESULT",
    "SETTLE_S",
    "SHM_HEIGHTS",
    "TYPED",
    "UNTYPED",
    "WAIT_S",
    "WIDTH",
    "Accounting",
    "Plan",
    "classify",
    "plan_request",
]


# The faults a faulty request gets, with their weights.  Kills are rarer: each ends an
# executor's life (its slot goes on with the warm spare while the dead one is checked).
FAULTS: Mapping[str, float] = {
    "raise": 1.0,  # the forward raises: RpcFailed
    "unpackable": 1.0,  # the packer refuses the output: RemoteError (UnsupportedOutputType)
    "abort": 1.0,  # drop_output, before or after the output arrived
    "cancel-call": 1.0,  # cancel handle.computed (the call, before its COMPUTE_DONE)
    "cancel-wait": 1.0,  # cancel handle.output, or the future of wait_output_ready (every other request)
    "consumer-gone": 0.5,  # release_consumer, before or after the call resolved
    "tight-wait": 1.0,  # the engine's own deadline of 0-5 ms, then cancel (docs/engine.md's fetch)
    "expire": 0.25,  # claimed only after the output deadline: OutputTimeout
    "kill": 0.25,  # SIGKILL of one worker: WorkerDied, then a new executor
}
# With --engine: how each fault reaches the request (the soak's plans are the same).
ENGINE_FAULTS: Mapping[str, str] = {
    "raise": "the same request: the forward raises (RpcFailed from generate)",
    "unpackable": "the same request: the packer refuses the output (RemoteError from generate)",
    "abort": "engine.abort(request_id), at once (early) or after the plan's delay",
    "cancel-call": "the generate task cancelled at once",
    "cancel-wait": "the generate task cancelled after the plan's delay",
    "consumer-gone": "engine.abort(request_id, wait=True): nothing of it may remain in the engine after",
    "tight-wait": "deadlines=: a compute deadline of the plan's 0-5 ms (ComputeTimeout, or a result)",
    "expire": "deadlines=: an output deadline of the plan's 0-5 ms (OutputTimeout, or a result)",
    "kill": "the same SIGKILL of one worker after generate started (WorkerDied, then a new executor)",
}
WIDTH = 64  # the model's width: an image of height h is h * 256 bytes
INLINE_HEIGHTS = (8, 32, 64, 128, 256)  # up to 64 KiB: inside the message
SHM_HEIGHTS = (512, 1024, 2048, 4096)  # 128 KiB to 1 MiB: a pooled segment
WAIT_S = 120.0  # a wait that runs out is a hang: an untyped TimeoutError, which fails the soak
SETTLE_S = 15.0  # how long an executor may take to release what ended requests left in flight
# WARMUP_REQUESTS and DRIVER_RSS_BOUND_MIB (the RSS checks' warm-up and the driver's bound) are in
# omni_async.cli.parsers: the options' help and defaults name them.

RESULT = "result"
CHANGED = "result with changed bytes"
CANCELLED = "cancelled"
ABORTED = "aborted"
CONSUMER_GONE = "aborted (consumer gone)"
TYPED = "typed error: "
UNTYPED = "untyped error: "


# ------------------------------------------------------------------------------ plans


@attrs.frozen
class Plan:
    """What request ``index`` does: its size and its fault (None: none)."""

    index: int
    fault: str | None
    height: int
    steps: int
    keep_trajectory: bool
    delay: float  # seconds before a cancel or a late abort; the engine's deadline for 'tight-wait'
    early: bool  # abort or release the consumer before the output arrives (or the call resolves)

    @property
    def request_id(self) -> str:
        return f"soak-{self.index}"

    def request(self) -> DiffusionRequest:
        params: dict[str, object] = {"seed": self.index, "height": self.height, "steps": self.steps}
        if self.keep_trajectory:
            params["keep_trajectory"] = True
        if self.fault in ("raise", "unpackable"):  # the model's switches, only where they are on
            params[self.fault] = True
        return DiffusionRequest(self.request_id, params)


def plan_request(seed: int, fault_rate: float, index: int) -> Plan:
    """Request ``index``'s plan: the same for the same seed, whatever ran before it."""
    rng = random.Random(f"omni-async-soak:{seed}:{index}")
    fault = None
    if rng.random() < fault_rate:
        fault = rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
    return Plan(
        index=index,
        fault=fault,
        height=rng.choice(INLINE_HEIGHTS if rng.random() < 0.5 else SHM_HEIGHTS),
        steps=rng.randint(1, 3),
        keep_trajectory=rng.random() < 0.2,
        delay=rng.uniform(0.0, 0.005),
        early=rng.random() < 0.5,
    )


# ------------------------------------------------------------------------------ accounting


class Accounting:
    """Every request's one outcome, in counters and one byte of state per request.

    ``start(i)`` when request ``i`` is handed to an engine thread, ``end(i, outcome)``
    when it ended; a request started or ended twice is counted in ``twice``, one that
    never ends is ``unaccounted``.
    """

    _NEW, _RUNNING, _ENDED = 0, 1, 2

    def __init__(self, requests: int) -> None:
        self.requests = requests
        self._state = bytearray(requests)
        self._lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.twice = 0

    def start(self, index: int) -> None:
        with self._lock:
            if self._state[index] != self._NEW:
                self.twice += 1
                return
            self._state[index] = self._RUNNING

    def end(self, index: int, outcome: str) -> None:
        with self._lock:
            if self._state[index] != self._RUNNING:
                self.twice += 1
                return
            self._state[index] = self._ENDED
            self.outcomes[outcome] += 1

    @property
    def ended(self) -> int:
        with self._lock:
            return sum(self.outcomes.values())

    @property
    def unaccounted(self) -> int:
        """Requests without an outcome: started and never ended, or never run."""
        return self.requests - self.ended


def classify(exc: BaseException) -> str:
    """A request's outcome when it ended with ``exc``: a typed error by class, or untyped."""
    if isinstance(exc, RemoteError):
        return f"{TYPED}RemoteError ({exc.failure.type_name})"
    if isinstance(exc, RpcFailed):
        kinds = sorted({f.type_name for f in exc.failures.values()})
        return f"{TYPED}RpcFailed ({', '.join(kinds)})"
    if isinstance(exc, OmniAsyncError):
        return f"{TYPED}{type(exc).__name__}"
    return f"{UNTYPED}{type(exc).__name__}"
