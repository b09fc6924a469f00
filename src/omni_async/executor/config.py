"""One validated configuration for the executors with ranks (processes, Ray actors).

``MultiprocDiffusionExecutor`` and ``RayDiffusionExecutor`` share eleven settings:
the world, step mode, deadlines, the worker-side options, the budget of held outputs,
how outputs are delivered, the start-up bound, the tracer.  They used to be repeated
argument by argument in both constructors, each checking them its own way (or not at
all).  Now they are one frozen ``ExecutorConfig``, checked once when it is made: a bad
value raises ``InvalidConfig`` naming the field.

Both executors take it as ``config=``, and still take each setting as a keyword
argument (``MultiprocDiffusionExecutor(spec, world_size=2)``): the keywords are typed
once, by ``ExecutorOptions`` (``**options: Unpack[ExecutorOptions]``), and override the
fields of ``config`` (``ExecutorConfig.with_options``).  Keeping the keywords was the
choice because every engine author, the README and the tests construct executors
that way; declaring them once (not once per executor) was the point of the issue.

Every field here (and in ``WorkerOptions`` and ``Deadlines``) is checked when it is made,
with the helpers of ``omni_async.core.config``; and each executor checks its own
arguments in its constructor's first line (``check_in_process_arguments``,
``check_multiproc_arguments``, ``check_ray_arguments``), before it spawns, maps or
imports anything: a setting that cannot work is an ``InvalidConfig`` there, not a
worker that dies at start-up, a pump thread that dies on its first message (a tracer
that is not callable: the constructor then waited out ``start_timeout``), or an
``AttributeError``/``OverflowError`` from deep inside.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Literal, TypedDict

import attrs
import torch

from omni_async.core.config import (
    Deadlines,
    InvalidConfig,
    check_bool,
    check_callable,
    check_choice,
    check_instance,
    check_int,
    check_seconds,
    given,
)
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput
from omni_async.core.trace import Tracer
from omni_async.transport.budget import DEFAULT_MAX_HELD_OUTPUTS, OutputBudget
from omni_async.transport.channel import InProcessChannel
from omni_async.transport.packing import leaf_nbytes, segment_nbytes
from omni_async.transport.shm import SegmentPool
from omni_async.worker.dist import BACKENDS, Backend
from omni_async.worker.host import WorkerOptions, WorkerSpec
from omni_async.worker.loop import WorkerLoop
from omni_async.worker.output_path import check_output_path

__all__ = [
    "RAY_TRANSPORTS",
    "ExecutorConfig",
    "ExecutorOptions",
    "InvalidConfig",
    "Prewarm",
    "ProcessGroupConfig",
    "check_in_process_arguments",
    "check_multiproc_arguments",
    "check_ray_arguments",
]


def _count(value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidConfig("prewarm", f"count must be a positive int or None, got {given(value)}")


@attrs.frozen
class Prewarm:
    """Shared-memory segments the executor makes (and its packing rank maps, and on CUDA
    pins) before the first request, so that no request pays for one: ``count`` of them,
    each the segment one output needs.  Build it by what you know of the output:

    * ``Prewarm.of_bytes(nbytes)``: a segment of ``nbytes`` (the bytes one output holds
      in shared memory: its ``metrics["pack_shm_bytes"]``, what ``SegmentPool.prewarm``
      takes);
    * ``Prewarm.of_tensor(shape, dtype)``: an output of one tensor of that shape and dtype;
    * ``Prewarm.of_output(sample)``: an output like ``sample`` (a ``DiffusionOutput`` or its
      ``output``: any structure the transport packs -- dicts, lists, tuples, attrs and
      dataclass instances; tensor, array and bytes leaves), sized by the transport's own
      rule (``packing.segment_nbytes``: small leaves travel inline, the rest at aligned
      offsets) with the worker's ``inline_threshold``.  Size what the packer receives:
      after a post-process's device stage, if the pipeline has one.

    ``count`` None: as many as the worker's packer holds at once plus two (one being
    read, one being released), within the budget of held outputs; a count or a size the
    budget cannot hold is an ``InvalidConfig``.  Nothing of ``sample`` is kept: its leaves'
    sizes only (``leaves``, in the packer's walk order; ``segment``, a size given as is).
    """

    leaves: tuple[int, ...] = ()
    count: int | None = None
    segment: int | None = None

    def __attrs_post_init__(self) -> None:
        ok = isinstance(self.leaves, tuple) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.leaves
        )
        if not ok:
            raise InvalidConfig(
                "prewarm", f"leaves must be a tuple of byte sizes (ints >= 0), got {given(self.leaves)}"
            )
        _count(self.count)
        if self.segment is not None and (
            isinstance(self.segment, bool) or not isinstance(self.segment, int) or self.segment < 1
        ):
            raise InvalidConfig("prewarm", f"segment must be a positive int (bytes) or None, got {given(self.segment)}")

    @classmethod
    def of_bytes(cls, nbytes: int, count: int | None = None) -> Prewarm:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise InvalidConfig("prewarm", f"nbytes must be a positive int, got {given(nbytes)}")
        _count(count)
        return cls(count=count, segment=nbytes)

    @classmethod
    def of_tensor(cls, shape: Sequence[int], dtype: torch.dtype, count: int | None = None) -> Prewarm:
        dims = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else None
        if dims is None or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise InvalidConfig("prewarm", f"shape must be a sequence of ints >= 0, got {given(shape)}")
        if not isinstance(dtype, torch.dtype):
            raise InvalidConfig("prewarm", f"dtype must be a torch.dtype, got {given(dtype)}")
        _count(count)
        return cls((math.prod(dims) * dtype.itemsize,), count)

    @classmethod
    def of_output(cls, sample: object, count: int | None = None) -> Prewarm:
        tree = sample.output if isinstance(sample, DiffusionOutput) else sample
        try:
            leaves = leaf_nbytes(tree)
        except UsageError as exc:  # UnsupportedOutputType too: the packer would refuse it
            raise InvalidConfig("prewarm", f"sample cannot be packed, so it cannot size a segment: {exc}") from exc
        _count(count)
        return cls(tuple(leaves), count)

    def segment_nbytes(self, inline_threshold: int) -> int:
        """The bytes of one output's segment (0: it travels inline, it needs none)."""
        if self.segment is not None:
            return self.segment
        return segment_nbytes(self.leaves, inline_threshold=inline_threshold)


class ExecutorOptions(TypedDict, total=False):
    """The keyword arguments every executor with ranks takes: the fields of ``ExecutorConfig``."""

    world_size: int
    reply_rank: int
    step_mode: bool
    deadlines: Deadlines | None
    options: WorkerOptions | None
    max_held_outputs: int | None
    max_held_bytes: int | None
    copy_outputs: bool
    start_timeout: float
    tracer: Tracer | None
    final_step_async: bool
    prewarm: Prewarm | None
    process_group: ProcessGroupConfig | bool


@attrs.frozen(kw_only=True)
class ProcessGroupConfig:
    """A ``torch.distributed`` process group over the executor's ranks, joined by every rank
    before its model is built (``ExecutorConfig.process_group``; see
    ``omni_async.worker.dist`` and "Models split across ranks" in docs/models.md).

    ``backend``: ``"gloo"`` or ``"nccl"`` (None: NCCL when ``WorkerOptions.device`` is a
    CUDA device, gloo otherwise); ``rendezvous``: ``"tcp"`` (a store the executor hosts on
    a port the kernel picks) or ``"file"`` (a file in a private temporary directory: one
    machine only); ``timeout``: seconds a rank may wait in one collective before it fails
    (None: the executor's compute deadline, 600 s when that is off -- no collective of a
    call can rightly take longer than the call); finite, at most ``core.config.MAX_SECONDS``.
    """

    backend: Backend | None = None
    rendezvous: Literal["tcp", "file"] = "tcp"
    timeout: float | None = None

    def __attrs_post_init__(self) -> None:
        check_choice("process_group.backend", self.backend, BACKENDS, optional=True)
        check_choice("process_group.rendezvous", self.rendezvous, ("tcp", "file"))
        check_seconds("process_group.timeout", self.timeout, optional=True)


@attrs.frozen(kw_only=True)
class ExecutorConfig:
    """What the executors with ranks share (see the module docstring).

    ``world_size`` ranks, ``reply_rank`` the one that ships the outputs; ``step_mode``
    (and its ``final_step_async`` default); ``deadlines`` (None: ``Deadlines.from_env()``
    when the executor is built); ``options``: the worker-side settings (None: the
    defaults, with ``reply_rank``; a different ``reply_rank`` in them is replaced by
    this one); ``max_held_outputs``/``max_held_bytes``: the budget of held outputs
    (``budget``; None: 64 outputs, and the pool's byte default); ``copy_outputs``:
    deliver owned copies instead of zero-copy views; ``start_timeout``: seconds until
    every rank has built its model; ``tracer``: the protocol trace; ``prewarm``: the
    segments to make before the first request (``Prewarm``; checked against the budget
    here when ``max_held_outputs``/``max_held_bytes`` are given, against the pool's when
    the executor has it: ``prewarm_plan``); ``process_group``: a ``ProcessGroupConfig``
    (``True``: its defaults; ``False``, the default: none) for a model split across
    ranks, ``process_group_config`` reads it as one or None.
    """

    world_size: int = 1
    reply_rank: int = 0
    step_mode: bool = False
    deadlines: Deadlines | None = None
    options: WorkerOptions | None = None
    max_held_outputs: int | None = None
    max_held_bytes: int | None = None
    copy_outputs: bool = False
    start_timeout: float = 120.0
    tracer: Tracer | None = None
    final_step_async: bool = False
    prewarm: Prewarm | None = None
    process_group: ProcessGroupConfig | bool = False

    def __attrs_post_init__(self) -> None:
        check_world("world_size", self.world_size, "reply_rank", self.reply_rank)
        if not isinstance(self.process_group, (bool, ProcessGroupConfig)):
            raise InvalidConfig(
                "process_group", f"must be a bool or a ProcessGroupConfig, got {given(self.process_group)}"
            )
        for name in ("step_mode", "copy_outputs"):
            check_bool(name, getattr(self, name))
        check_final_step_async(self.final_step_async, self.step_mode)
        check_instance("deadlines", self.deadlines, Deadlines, optional=True)
        check_instance("options", self.options, WorkerOptions, optional=True)
        check_int("max_held_outputs", self.max_held_outputs, 1, optional=True)
        check_int("max_held_bytes", self.max_held_bytes, 1, optional=True)
        check_seconds("start_timeout", self.start_timeout)
        # A tracer that is not one failed in the result pump's thread, and the executor
        # then waited out start_timeout for answers it had dropped.
        check_callable("tracer", self.tracer, "a Tracer: a callable (action, fields)", optional=True)
        # InvalidOutputPath (a UsageError of its own, which callers catch by name).
        check_output_path(self.worker_options.output_path, step_mode=self.step_mode)
        if self.prewarm is not None:
            if not isinstance(self.prewarm, Prewarm):
                raise InvalidConfig(
                    "prewarm",
                    f"must be a Prewarm (Prewarm.of_bytes, .of_tensor or .of_output) or None, got {given(self.prewarm)}",
                )
            self._prewarm_segment()
            if self.max_held_outputs is not None or self.max_held_bytes is not None:
                self.prewarm_plan(self.budget)  # the executor checks it again against its pool's

    def prewarm_plan(self, budget: OutputBudget) -> tuple[int, int] | None:
        """``(segment bytes, count)`` of ``prewarm`` under ``budget`` (the pool's, once the
        executor has one); None without ``prewarm``.  ``InvalidConfig`` when the output
        needs no segment, or when the budget cannot hold the segments at once."""
        if self.prewarm is None:
            return None
        opts = self.worker_options
        nbytes = self._prewarm_segment()
        size = budget.size_class(nbytes)
        by_bytes = None if budget.max_bytes is None else budget.max_bytes // size
        count = self.prewarm.count
        if count is None:
            fit = budget.max_outputs if by_bytes is None else min(budget.max_outputs, by_bytes)
            count = max(1, min(opts.max_outputs_in_flight + 2, fit))
        elif count > budget.max_outputs:
            raise InvalidConfig(
                "prewarm",
                f"count={count} is more than max_held_outputs={budget.max_outputs} segments can be held at once; "
                "lower the count or raise max_held_outputs",
            )
        if by_bytes is not None and count > by_bytes:
            raise InvalidConfig(
                "prewarm",
                f"needs {count} segment(s) of {size} bytes (an output of {nbytes} bytes, in the pool's size class), "
                f"{count * size} bytes in all, over max_held_bytes={budget.max_bytes}; lower the count or raise "
                "max_held_bytes",
            )
        return nbytes, count

    def _prewarm_segment(self) -> int:
        """The bytes of ``prewarm``'s segment; ``InvalidConfig`` when the output needs none."""
        assert self.prewarm is not None
        threshold = self.worker_options.inline_threshold
        nbytes = self.prewarm.segment_nbytes(threshold)
        if nbytes == 0:
            raise InvalidConfig(
                "prewarm",
                f"sizes an output that travels inline (every leaf within inline_threshold={threshold} bytes): it "
                "uses no segment, there is nothing to prewarm; drop prewarm=",
            )
        return nbytes

    def with_options(self, options: ExecutorOptions) -> ExecutorConfig:
        """This configuration with the fields ``options`` names replaced (checked again)."""
        unknown = set(options) - set(attrs.fields_dict(ExecutorConfig))
        if unknown:  # a dict built at run time, past the type checker
            raise InvalidConfig(sorted(unknown)[0], "is not a setting of an executor (ExecutorConfig)")
        return attrs.evolve(self, **options) if options else self

    @property
    def worker_options(self) -> WorkerOptions:
        """``options``, with this configuration's ``reply_rank``."""
        opts = self.options if self.options is not None else WorkerOptions(reply_rank=self.reply_rank)
        return opts if opts.reply_rank == self.reply_rank else attrs.evolve(opts, reply_rank=self.reply_rank)

    @property
    def process_group_config(self) -> ProcessGroupConfig | None:
        """``process_group`` as a ``ProcessGroupConfig`` (``True``: the defaults), or None when off."""
        pg = self.process_group
        if isinstance(pg, ProcessGroupConfig):
            return pg
        return ProcessGroupConfig() if pg else None

    @property
    def budget(self) -> OutputBudget:
        """The budget of held outputs asked for (the pool's byte default still open: None)."""
        held = self.max_held_outputs if self.max_held_outputs is not None else DEFAULT_MAX_HELD_OUTPUTS
        return OutputBudget(max_outputs=held, max_bytes=self.max_held_bytes)


def check_world(world_field: str, world_size: object, reply_field: str, reply_rank: object) -> None:
    """``world_size`` ranks (>= 1), ``reply_rank`` one of them."""
    check_int(world_field, world_size, 1)
    check_int(reply_field, reply_rank, 0)
    assert isinstance(world_size, int) and isinstance(reply_rank, int)
    if reply_rank >= world_size:
        raise InvalidConfig(reply_field, f"must be below {world_field}={given(world_size)}, got {given(reply_rank)}")


def check_final_step_async(final_step_async: object, step_mode: object) -> None:
    check_bool("final_step_async", final_step_async)
    if final_step_async and not step_mode:
        raise InvalidConfig(
            "final_step_async",
            "True is an option of step mode (step_mode=True); request mode always takes the asynchronous path",
        )


# The WorkerLoop arguments InProcessExecutor sets itself: ``loop_options`` may not name them.
_LOOP_SET = frozenset({"rank", "worker", "sender", "reply_rank", "packer", "tracer"})


def check_in_process_arguments(
    make_worker: object,
    *,
    world_size: object,
    reply_rank: object,
    step_mode: object,
    deadlines: object,
    max_outputs_in_flight: object,
    tracer: object,
    channel: object,
    make_packer: object,
    loop_options: object,
    release_hook: object,
    validate_request: object,
    postprocess: object,
    final_step_async: object,
) -> None:
    """``InProcessExecutor``'s arguments, checked before it builds anything: ``InvalidConfig``
    naming the first that cannot work (its thread-side failures were an AttributeError, or
    a worker thread that died)."""
    check_callable("make_worker", make_worker, "a callable rank -> model (a model class, say)")
    check_world("world_size", world_size, "reply_rank", reply_rank)
    check_bool("step_mode", step_mode)
    check_final_step_async(final_step_async, step_mode)
    check_instance("deadlines", deadlines, Deadlines, optional=True)
    check_int("max_outputs_in_flight", max_outputs_in_flight, 1)
    check_callable("tracer", tracer, "a Tracer: a callable (action, fields)", optional=True)
    check_instance("channel", channel, InProcessChannel, optional=True)
    check_callable("make_packer", make_packer, "a callable (rank, sender) -> Packer", optional=True)
    if loop_options is not None:
        if not isinstance(loop_options, Mapping):
            raise InvalidConfig(
                "loop_options", f"must be a mapping of WorkerLoop arguments or None, got {given(loop_options)}"
            )
        known = set(inspect.signature(WorkerLoop).parameters) - _LOOP_SET
        unknown = sorted(str(k) for k in loop_options if k not in known)
        if unknown:
            raise InvalidConfig(
                "loop_options", f"names {unknown}, not among the WorkerLoop arguments it may set: {sorted(known)}"
            )
    check_callable("release_hook", release_hook, "a callable (output) -> None")
    check_callable("validate_request", validate_request, "a callable (request) -> None", optional=True)
    if postprocess is not None and (not isinstance(postprocess, str) or not postprocess):
        raise InvalidConfig(
            "postprocess", f"must be a registered pipeline name (str) or None, got {given(postprocess)}"
        )


def check_multiproc_arguments(spec: object, config: object, *, pool: object, sweep_dead_pools: object) -> None:
    """``MultiprocDiffusionExecutor``'s own arguments (its ``ExecutorConfig`` fields check
    themselves), before it spawns anything."""
    _check_spec(spec)
    check_instance("config", config, ExecutorConfig, optional=True, hint="or pass its fields as keyword arguments")
    check_instance("pool", pool, SegmentPool, optional=True, hint="or None: the executor makes its own")
    check_bool("sweep_dead_pools", sweep_dead_pools)


# How ``RayDiffusionExecutor`` ships its ranks' outputs (its ``transport`` argument).
RAY_TRANSPORTS = ("auto", "shm", "object_store")
# Ray's placement strategies (``ray.util.placement_group``).
_RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def check_ray_arguments(
    spec: object,
    config: object,
    *,
    num_cpus_per_rank: object,
    num_gpus_per_rank: object,
    placement_strategy: object,
    transport: object,
    fetch_threads: object,
) -> None:
    """``RayDiffusionExecutor``'s own arguments, before it imports or starts Ray
    (``placement_group``, a Ray type, is checked once Ray is imported)."""
    _check_spec(spec)
    check_instance("config", config, ExecutorConfig, optional=True, hint="or pass its fields as keyword arguments")
    _check_resource("num_cpus_per_rank", num_cpus_per_rank, optional=False)
    _check_resource("num_gpus_per_rank", num_gpus_per_rank, optional=True)
    check_choice("placement_strategy", placement_strategy, _RAY_STRATEGIES)
    check_choice("transport", transport, RAY_TRANSPORTS)
    check_int("fetch_threads", fetch_threads, 1)


def _check_spec(spec: object) -> None:
    if not isinstance(spec, WorkerSpec):
        raise InvalidConfig(
            "spec", f"must be a WorkerSpec, got {given(spec)}: WorkerSpec('mypkg.models:MyWorker', kwargs={{...}})"
        )


def _check_resource(field: str, value: object, *, optional: bool) -> None:
    """A Ray resource count: a finite number >= 0 (fractions share a CPU or GPU)."""
    if value is None and optional:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf:
        return
    raise InvalidConfig(field, f"must be a finite number >= 0{' or None' if optional else ''}, got {given(value)}")
