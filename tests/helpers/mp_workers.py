"""Worker models for the multiprocess tests (imported by name in spawned workers)."""

from __future__ import annotations

import enum
import os
import signal
import time
from collections.abc import Mapping, Sequence
from typing import NoReturn

import torch

from omni_async.core.messages import BatchDiffusionOutput, DiffusionOutput, DiffusionRequest
from omni_async.worker.cancel import raise_if_cancelled


class Unpackable:
    """A leaf the packer cannot ship (no attrs/dataclass, not plain)."""


class KillOnSend(enum.Enum):
    """A plain value whose pickling SIGKILLs the process that pickles it.

    An enum member travels in the packed skeleton as it is, so the packer copies the
    output into its segment and hands the lease off as usual; ``PipeSender.put`` then
    pickles the OUTPUT_READY, in the packer's thread, before it writes a byte: the
    worker dies after ``SegmentPool.hand_off`` and before its message is sent -- the
    window of the long soak's leaked lease, hit every time.
    """

    NOW = "now"

    def __reduce_ex__(self, proto: object) -> NoReturn:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("still alive after SIGKILL")


class Fatal(BaseException):
    """Not an ``Exception``: the worker loop does not answer it, it ends the worker."""


class ScriptedWorker:
    """Does what each request's params say: sleep (``cancellable_sleep``: one that
    honours cancellation), raise, exit, or return an output of a given size
    (``die_in_send``: one that kills the worker as its OUTPUT_READY is sent, see ``KillOnSend``)."""

    def __init__(self, rank: int = 0, fail_rank: int | None = None) -> None:
        self.rank = rank
        self.fail_rank = fail_rank

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        return self._forward(request)

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchDiffusionOutput:
        return BatchDiffusionOutput(tuple(self._forward(r) for r in requests))

    def pid(self) -> int:
        return os.getpid()

    def fail(self) -> None:
        raise ValueError(f"rank {self.rank} fails on purpose")

    def sleep(self) -> str:
        return "asleep"

    def _forward(self, request: DiffusionRequest) -> DiffusionOutput:
        p = request.params
        if p.get("sleep"):
            time.sleep(float(p["sleep"]))
        if p.get("cancellable_sleep"):
            # A forward that honours cancellation: checks every 10 ms.
            end = time.monotonic() + float(p["cancellable_sleep"])
            while time.monotonic() < end:
                raise_if_cancelled()
                time.sleep(0.01)
        if p.get("raise") or (self.fail_rank is not None and self.rank == self.fail_rank):
            raise RuntimeError(f"forward of {request.request_id} failed on rank {self.rank}")
        if p.get("exit"):
            os._exit(int(p["exit"]))
        if p.get("fatal"):
            raise Fatal(f"forward of {request.request_id}: {p['fatal']}")
        n = int(p.get("numel", 1 << 16))
        dtype = getattr(torch, str(p.get("dtype", "float32")))
        gen = torch.Generator().manual_seed(int(p.get("seed", 0)))
        if dtype.is_floating_point:
            image = torch.randn(n, generator=gen).to(dtype)
        else:
            image = torch.randint(-100, 100, (n,), generator=gen).to(dtype)
        out: dict[str, object] = {"image": image, "note": request.request_id}
        if p.get("unpackable"):
            out["bad"] = Unpackable()
        if p.get("die_in_send"):
            out["fate"] = KillOnSend.NOW
        return DiffusionOutput(request.request_id, out)


def expected_image(params: Mapping[str, object]) -> torch.Tensor:
    n = int(params.get("numel", 1 << 16))  # type: ignore[call-overload]
    dtype = getattr(torch, str(params.get("dtype", "float32")))
    gen = torch.Generator().manual_seed(int(params.get("seed", 0)))  # type: ignore[call-overload]
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype)
    return torch.randint(-100, 100, (n,), generator=gen).to(dtype)


class TorchThreadsWorker:
    """Answers with the number of torch intra-op threads of its process."""

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        return DiffusionOutput(request.request_id, {"threads": torch.get_num_threads()})


class BrokenWorker:
    """A model whose construction fails on ``fail_rank`` (all ranks when None): a start-up failure."""

    def __init__(self, rank: int = 0, fail_rank: int | None = None) -> None:
        if fail_rank is None or rank == fail_rank:
            raise FileNotFoundError(f"rank {rank}: no weights at /nonexistent/model.safetensors")
        self.rank = rank

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput:
        return DiffusionOutput(request.request_id, {})


class StepwiseWorker:
    """A model run step by step (step mode): each ``execute_model`` call advances its request
    one denoising step (``step_ms`` of "device" time, a sleep that leaves the CPU to the
    packer, as a GPU forward does) and returns None, until the last of ``steps`` calls,
    which returns the output: ``numel`` float32 values, seeded by ``seed``
    (``expected_image``), freshly made by the final step (the packer copies it while the
    next request's first step runs)."""

    def __init__(self) -> None:
        self.progress: dict[str, int] = {}

    def execute_model(self, request: DiffusionRequest) -> DiffusionOutput | None:
        p = request.params
        steps = int(p.get("steps", 4))
        time.sleep(float(p.get("step_ms", 0)) / 1000.0)
        done = self.progress.get(request.request_id, 0) + 1
        if done < steps:
            self.progress[request.request_id] = done
            return None
        self.progress.pop(request.request_id, None)
        return DiffusionOutput(request.request_id, {"image": expected_image(p), "steps": steps})

    def pending(self) -> int:
        return len(self.progress)


def _check_size(request: DiffusionRequest) -> None:
    from omni_async.core.errors import InvalidRequest

    size = request.params.get("size", 1)
    if not isinstance(size, int) or size < 1:
        raise InvalidRequest(request.request_id, "size", f"must be a positive int, got {size!r}")


class InstanceValidated(ScriptedWorker):
    """Checks its requests in an instance method: refused by both executors (issue 17, defect 12)."""

    def validate_request(self, request: DiffusionRequest) -> None:
        _check_size(request)


class ClassValidated(ScriptedWorker):
    """Checks its requests in a class method: run by the executor in the caller's thread."""

    @classmethod
    def validate_request(cls, request: DiffusionRequest) -> None:
        _check_size(request)


def make_validated(rank: int = 0) -> ScriptedWorker:
    """A factory function carrying the check as an attribute (as ``omni_async.models.dit:make_worker``)."""
    return ScriptedWorker(rank)


make_validated.validate_request = _check_size  # type: ignore[attr-defined]
