"""The worker's host: what every rank runs, whatever carries it (a process, a Ray actor).

``WorkerSpec`` says how a rank builds its model, ``WorkerOptions`` the worker-side
settings; ``build_worker`` turns both into the rank's ``Packer`` and ``WorkerLoop`` on
the rank's device (``device_for_rank``).  A worker process runs them from
``omni_async.worker.process``; ``RayDiffusionExecutor``'s actors from their own thread.
Both live here, in the worker layer, because they run where the model runs: the
executor only sends a ``WorkerSpec`` and ``WorkerOptions`` across.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, cast

import attrs

from omni_async.core.config import InvalidConfig, check_bool, check_int, check_seconds, given
from omni_async.core.errors import UsageError
from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.transport.channel import ResultSender
from omni_async.transport.errors import HeldOutputsFull, PoolExhausted
from omni_async.transport.packing import PackInFlight, release_packed_output, start_pack_shm
from omni_async.transport.platform import CopyStream, DeviceEvent
from omni_async.transport.rpc import pickle_problem
from omni_async.transport.shm import SegmentPool
from omni_async.worker.affinity import apply_cpu_affinity, check_cpu_affinity, cpu_affinity_value
from omni_async.worker.dist import DistContext, Rendezvous, join_process_group
from omni_async.worker.loop import WorkerLoop
from omni_async.worker.output_path import OMNI, OutputPath, check_output_path, resolve_output_path
from omni_async.worker.packer import Packer, PackFn, StartPackFn
from omni_async.worker.postprocess import DeviceStage, get_postprocess
from omni_async.worker.validation import check_model_hooks, model_batch_keyer, spec_validator

if TYPE_CHECKING:
    import torch

__all__ = ["WorkerOptions", "WorkerSpec", "budget_full", "build_worker", "device_for_rank", "device_setup"]

_SPEC_HINT = "pass the import path, e.g. 'mypkg.models:MyWorker'"


@attrs.frozen
class WorkerSpec:
    """How a worker process builds its model: ``"package.module:factory"`` plus keyword arguments.

    The factory is called as ``factory(**kwargs)``; with ``pass_rank`` it also gets
    ``rank=``, with ``pass_dist`` ``dist=`` (a ``DistContext``: rank, world size, device
    and the ranks' process group, joined before the factory runs; the executor needs
    ``process_group`` on, see ``omni_async.worker.dist``).  A string, not a callable, so
    that it pickles into a spawned process.

    The constructor checks the fields (``UsageError`` naming the problem) and, with
    ``check_import`` (the default), imports the factory here, in the engine's process:
    a typo fails now rather than as a worker that dies at start-up.  Turn it off for a
    module that must not be imported outside a worker (one that initialises a device
    at import time, say); the worker then reports the import error at start-up.

    A factory with a static (or class) method ``validate_request(request)`` -- or, for
    a factory function, such an attribute -- gets it called by the executor on every
    request before sending it (``request_validator``): a bad request fails in the
    caller's thread, and no worker sees it.  A factory class whose ``validate_request``
    is an instance method is refused here (``UsageError``): the executor could not run
    it, and a bad request would reach the model unchecked.  A model whose checks depend on
    how it is built (a pipeline's config) gives instead a static (or class) method
    ``request_validator(**kwargs)``: the executor calls it once with these kwargs and runs
    the validator it returns.  A static (or class) ``batch_key(request)`` says which
    requests may share a batched forward (``batch_keyer``).  The kwargs must pickle (they
    travel to every worker): one that does not is refused here, named.

    ``postprocess``: the pipeline name of a registered ``PostProcess`` whose ``device``
    stage the worker's packer runs on every output before the copy (see
    ``omni_async.worker.postprocess``).  The worker looks it up after building the
    model (the factory's module, imported there, registers it); with ``check_import``
    the constructor looks it up here too, so an unknown name fails now
    (``UnknownPostProcess``), not as a worker that cannot start.
    """

    factory: str
    kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    pass_rank: bool = False
    check_import: bool = attrs.field(default=True, kw_only=True)
    postprocess: str | None = attrs.field(default=None, kw_only=True)
    pass_dist: bool = attrs.field(default=False, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.factory, str):
            raise UsageError(
                f"WorkerSpec.factory must be a 'module:callable' string (it travels to the worker "
                f"processes by name), got {type(self.factory).__name__} {self.factory!r}: {_SPEC_HINT}"
            )
        module, _, name = self.factory.partition(":")
        if not module or not name or not all(p.isidentifier() for p in (*module.split("."), *name.split("."))):
            raise UsageError(f"WorkerSpec.factory must be 'module:callable', got {self.factory!r}: {_SPEC_HINT}")
        if not isinstance(self.kwargs, Mapping):
            raise UsageError(
                f"WorkerSpec.kwargs must be a mapping of keyword arguments, got {type(self.kwargs).__name__} "
                f"{self.kwargs!r}"
            )
        bad_keys = [k for k in self.kwargs if not isinstance(k, str)]
        if bad_keys:
            raise UsageError(f"WorkerSpec.kwargs keys must be str (keyword arguments), got {bad_keys!r}")
        for key, value in self.kwargs.items():
            problem = pickle_problem(value, spawning=True)
            if problem is not None:
                raise UsageError(
                    f"WorkerSpec.kwargs[{key!r}] does not pickle ({type(problem).__name__}: {problem}): the "
                    "kwargs travel to every worker process by pickle; pass data (or an import path) and "
                    "build the object in the factory"
                )
        for field in ("pass_rank", "check_import", "pass_dist"):
            if not isinstance(getattr(self, field), bool):
                raise UsageError(f"WorkerSpec.{field} must be a bool, got {getattr(self, field)!r}")
        if self.postprocess is not None and (not isinstance(self.postprocess, str) or not self.postprocess):
            raise UsageError(
                f"WorkerSpec.postprocess must be a registered pipeline name (str) or None, got {self.postprocess!r}"
            )
        if self.check_import:
            check_model_hooks(self.resolve(), f"WorkerSpec({self.factory!r})")  # the one rule, checked now
            self.device_stage()

    def device_stage(self) -> DeviceStage | None:
        """The device stage of ``postprocess`` in this process (None without one);
        ``UnknownPostProcess`` when no post-process is registered under the name."""
        if self.postprocess is None:
            return None
        return get_postprocess(self.postprocess).device

    def resolve(self) -> Callable[..., object]:
        """Import the factory in this process; ``UsageError`` when it cannot be found."""
        module_name, _, qualname = self.factory.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception as exc:
            raise UsageError(
                f"WorkerSpec.factory {self.factory!r}: cannot import {module_name!r} "
                f"({type(exc).__name__}: {exc}); {_SPEC_HINT}"
            ) from exc
        for part in qualname.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError as exc:
                raise UsageError(f"WorkerSpec.factory {self.factory!r}: {module_name!r} has no {qualname!r}") from exc
        if not callable(obj):
            raise UsageError(f"WorkerSpec.factory {self.factory!r} is a {type(obj).__name__}, not a callable")
        return cast("Callable[..., object]", obj)

    def request_validator(self) -> Callable[[DiffusionRequest], None] | None:
        """The check the executor runs on every request in the caller's thread: the
        factory's ``request_validator(**kwargs)`` called with this spec's kwargs when it
        has one, else its ``validate_request`` (a static or class method, or a factory
        function's attribute); None without either, and without ``check_import`` (the
        factory is not imported here).  An instance method is refused (``UsageError``):
        see ``omni_async.worker.validation``."""
        if not self.check_import:
            return None
        return spec_validator(self.resolve(), self.kwargs, f"WorkerSpec({self.factory!r})")

    def batch_keyer(self) -> Callable[[DiffusionRequest], Hashable | None] | None:
        """The factory's ``batch_key(request)`` (a static or class method, or a factory
        function's attribute): requests with equal keys may share one batched forward
        (``execute_model_batch``), a key of None means the request runs alone.  None when
        the factory has none (no request is batched), and without ``check_import``."""
        if not self.check_import:
            return None
        return model_batch_keyer(self.resolve(), f"WorkerSpec({self.factory!r})")

    def build(self, rank: int, dist: DistContext | None = None) -> object:
        factory = self.resolve()
        kwargs = dict(self.kwargs)
        if self.pass_rank:
            kwargs["rank"] = rank
        if self.pass_dist:
            if dist is None:
                raise UsageError(
                    f"WorkerSpec({self.factory!r}, pass_dist=True) on rank {rank}: the ranks share no process "
                    "group; build the executor with process_group=True (ExecutorConfig.process_group)"
                )
            kwargs["dist"] = dist
        return factory(**kwargs)


@attrs.frozen
class WorkerOptions:
    """Worker-side settings, sent to every worker process; each checked when it is made
    (``InvalidConfig`` naming ``WorkerOptions.<field>``), so that a bad one fails here and
    not in every worker at start-up or on every output.

    ``device``: a device ``torch.device`` reads (``"cuda"`` without an index: by rank,
    ``device_for_rank``); ``max_outputs_in_flight`` (>= 1) and ``max_bytes_in_flight``
    (>= 1 or None): the packer's budget, which back-pressures the forwards;
    ``backpressure_timeout``: seconds a forward waits for that room before its call fails
    (None: without a bound; 0: at once); ``inline_threshold``: the largest leaf in bytes
    that travels in the message instead of in shared memory (>= 0).
    """

    reply_rank: int = 0
    device: str = "cpu"
    max_outputs_in_flight: int = 4
    max_bytes_in_flight: int | None = None
    backpressure_timeout: float | None = None
    inline_threshold: int = 64 << 10
    # How long packing waits for room in the budget of held outputs before the output
    # fails with HeldOutputsFull (None: the pool's own lease timeout).
    lease_timeout: float | None = 30.0
    # How outputs are shipped: ours ("omni", the pool's), or the name or import path of
    # an ``OutputPath`` ("sync" and "reference": the paths ``omni-async bench`` measures
    # ours against); see ``omni_async.worker.output_path``.
    output_path: str = OMNI
    # The packer starts on a forward's outputs once the next forward has started (or the
    # worker has no request to run): its Python then never delays the next forward's
    # launch (``WorkerLoop.idle``).  False: as soon as COMPUTE_DONE is out.
    defer_packing: bool = True
    # How many outputs may have their device-to-host copies queued at once on the
    # "omni" path: with 2 the next output's copy is queued before the previous one
    # has finished, so the copy engine does not idle between them while the packer
    # sends (``omni_async.worker.packer``); 1: one at a time.
    copies_in_flight: int = 2
    # Which CPUs each worker process runs on: None (as inherited), "gpu-local" (the CPUs
    # local to the rank's GPU) or CPU numbers (``omni_async.worker.affinity``).  A list
    # is kept as a sorted tuple.
    cpu_affinity: str | tuple[int, ...] | None = attrs.field(default=None, converter=cpu_affinity_value)
    # Forwards (``execute_model``, ``execute_model_batch``) and the packer's threads run
    # under ``torch.inference_mode()``: no autograd bookkeeping on each op, which a forward
    # bound by its kernel launches feels (``WorkerLoop``'s ``forward_mode``).  Their
    # tensors are then inference tensors.  False for a model whose forward needs autograd
    # (one may instead wrap that part in ``torch.inference_mode(False)``).
    inference_mode: bool = True

    def __attrs_post_init__(self) -> None:
        check_int("WorkerOptions.reply_rank", self.reply_rank, 0)
        check_device("WorkerOptions.device", self.device)
        check_int("WorkerOptions.max_outputs_in_flight", self.max_outputs_in_flight, 1)
        check_int("WorkerOptions.max_bytes_in_flight", self.max_bytes_in_flight, 1, optional=True)
        check_seconds("WorkerOptions.backpressure_timeout", self.backpressure_timeout, optional=True, zero=True)
        check_int("WorkerOptions.inline_threshold", self.inline_threshold, 0)
        # 0: an output that finds the budget full fails at once (HeldOutputsFull).
        check_seconds("WorkerOptions.lease_timeout", self.lease_timeout, optional=True, zero=True)
        # InvalidConfig for a value that is no string; InvalidOutputPath (which callers
        # catch by name) for one that names no OutputPath.
        check_output_path(self.output_path)
        check_bool("WorkerOptions.defer_packing", self.defer_packing)
        check_int("WorkerOptions.copies_in_flight", self.copies_in_flight, 1)
        check_bool("WorkerOptions.inference_mode", self.inference_mode)
        object.__setattr__(self, "cpu_affinity", check_cpu_affinity(self.cpu_affinity, self.device))


def check_device(field: str, value: object) -> None:
    """A device name ``torch.device`` reads (``"cpu"``, ``"cuda"``, ``"cuda:1"``...): a
    typo fails when the options are made, not in every worker as it starts."""
    import torch

    if not isinstance(value, str):
        raise InvalidConfig(field, f"must be a device name (str) such as 'cpu' or 'cuda:0', got {given(value)}")
    try:
        torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise InvalidConfig(
            field, f"must be a device name such as 'cpu' or 'cuda:0', got {given(value)}: {exc}"
        ) from None


def device_for_rank(device: str, rank: int, device_count: int) -> str:
    """The device rank ``rank`` computes on: ``"cuda"`` without an index puts rank r on
    ``cuda:r`` when the machine has that many GPUs, round-robin when it has fewer
    (``cuda:{r % count}``); an explicit index, or another device, is used as given."""
    if device == "cuda" and device_count > 0:
        return f"cuda:{rank % device_count}"
    return device


def device_setup(device: str, rank: int = 0) -> torch.device:
    """Select rank ``rank``'s device (``device_for_rank``) on the calling thread; returns it."""
    import torch

    count = torch.cuda.device_count() if device == "cuda" else 0
    dev = torch.device(device_for_rank(device, rank, count))
    if dev.type == "cuda":
        if str(dev) == "cuda":  # no GPU counted: the process's current device
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def build_worker(
    rank: int,
    spec: WorkerSpec,
    opts: WorkerOptions,
    pool: SegmentPool | None,
    sender: ResultSender,
    *,
    packing: tuple[PackFn, Callable[[DiffusionOutput], None]] | None = None,
    rendezvous: Rendezvous | None = None,
) -> tuple[Packer, WorkerLoop]:
    """The worker's model, packer and loop (the packer not started yet).

    ``packing``: (pack, release) replacing the pool's (the Ray executor's object-store
    path, where ``pool`` is None: a remote node cannot attach to it).  ``rendezvous``:
    join the executor's process group on the rank's device before the model is built
    (``omni_async.worker.dist``); the caller leaves it (``leave_process_group``) when the
    rank stops.
    """
    import torch

    from omni_async.transport.clock import DeviceClock
    from omni_async.transport.device_copy import warm_copy_path
    from omni_async.transport.platform import record_device_event

    dev = device_setup(opts.device, rank)
    # Before the model is built: its host memory is first touched on the pinned CPUs' node.
    apply_cpu_affinity(opts.cpu_affinity, dev, rank)
    # One clock for the loop (which marks each forward) and the packer (which marks each
    # copy and reads them all): the timings true to the device (omni_async.worker.stamps).
    clock = DeviceClock(dev)

    def make_stream() -> CopyStream:
        # Runs on the packer thread: the current device is per thread, set it first.
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated
            warm_copy_path(stream)  # while starting, not in the first request's pack
            return stream
        return None

    def start_omni(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> PackInFlight:
        assert pool is not None
        try:
            return start_pack_shm(
                output,
                stream,
                pool=pool,
                inline_threshold=opts.inline_threshold,
                ready_event=event,
                lease_timeout=opts.lease_timeout,
            )
        except PoolExhausted as exc:
            if isinstance(exc.__cause__, OSError):  # /dev/shm itself is full, not the budget
                raise
            raise budget_full(output, exc, pool) from exc

    def pack_omni(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        return start_omni(output, stream, event).finish()

    def release_pooled(packed: DiffusionOutput) -> None:
        assert pool is not None
        release_packed_output(packed, pool=pool)

    pack: PackFn = pack_omni
    start_pack: StartPackFn | None = start_omni
    release: Callable[[DiffusionOutput], None] = release_pooled
    if opts.output_path != OMNI and packing is None:
        # An output path of its own replaces ours for both the packer and step mode's answers.
        path = resolve_output_path(opts.output_path)
        assert path is not None and pool is not None
        pack, release = _path_packing(path, pool, opts.inline_threshold)
        start_pack = None
    if packing is not None:
        pack, release = packing
        start_pack = None

    dist = join_process_group(rank, rendezvous, dev) if rendezvous is not None else None
    worker = spec.build(rank, dist)
    # After the build: importing the factory's module registers its post-processes here.
    stage = spec.device_stage()
    # The forwards' and the packer's mode (WorkerOptions.inference_mode).
    mode: Callable[[], contextlib.AbstractContextManager[object]] = (
        torch.inference_mode if opts.inference_mode else contextlib.nullcontext
    )
    if spec.postprocess is not None:
        # Compiling a fused device stage takes seconds: here, before the first request,
        # rather than in its first pack (``PostProcess.warmup``); in the packer's mode,
        # which the compiled kernel's guards check.
        with mode():
            get_postprocess(spec.postprocess).warm_up(dev)
    packer = Packer(
        rank,
        sender,
        pack=pack,
        release=release,
        make_stream=make_stream,
        max_outputs=opts.max_outputs_in_flight,
        max_bytes=opts.max_bytes_in_flight,
        interrupt=pool.cancel_waits if pool is not None else None,
        device_stage=stage,
        clock=clock,
        start_pack=start_pack,
        copies_in_flight=opts.copies_in_flight,
        thread_mode=mode,
    )
    loop = WorkerLoop(
        rank,
        worker,
        sender,
        reply_rank=opts.reply_rank,
        packer=packer,
        pack_sync=pack,
        record_event=lambda: record_device_event(dev),
        backpressure_timeout=opts.backpressure_timeout,
        device_stage=stage,
        clock=clock,
        forward_mode=mode,
    )
    if pool is not None and packing is None and opts.output_path == OMNI and rank == opts.reply_rank:
        # The rank that packs maps (and on CUDA pins) the segments made ahead of it, now
        # rather than in its first packs (SegmentPool.map_segments).
        mapped, pinned = pool.map_segments()
        loop.mapped_segments, loop.pinned_segments = mapped, pinned
    return packer, loop


def _path_packing(
    path: OutputPath, pool: SegmentPool, inline_threshold: int
) -> tuple[PackFn, Callable[[DiffusionOutput], None]]:
    """(pack, release) of a rank that ships on ``path``: what it packed goes back to it."""

    def pack(output: DiffusionOutput, stream: CopyStream, event: DeviceEvent | None) -> DiffusionOutput:
        return path.pack(output, stream, event, prefix=pool.prefix, inline_threshold=inline_threshold)

    def release(packed: DiffusionOutput) -> None:
        if path.owns(packed):
            path.discard(packed)
        else:
            release_packed_output(packed, pool=pool)

    return pack, release


def budget_full(output: DiffusionOutput, exc: PoolExhausted, pool: SegmentPool) -> HeldOutputsFull:
    """The error of an output that found no room in the budget of held outputs."""
    try:
        st = pool.stats()
        held = f"{st.outstanding} of max_held_outputs={pool.max_segments} outputs and {st.bytes_leased} of "
    except Exception:  # noqa: BLE001  # closing at shutdown: the numbers are not essential
        held = f"up to max_held_outputs={pool.max_segments} outputs and "
    return HeldOutputsFull(
        f"output {output.async_output_id} of request {output.request_id!r} found no room in the budget of held "
        f"outputs within lease_timeout={exc.timeout} s: {held}max_held_bytes={pool.max_bytes} bytes are held in "
        f"shared memory (packed, not yet released); it needs {exc.nbytes} bytes.  Release outputs sooner "
        "(release_output after wait_output_ready, or drop_output), or raise "
        "MultiprocDiffusionExecutor(max_held_outputs=..., max_held_bytes=...)",
        nbytes=exc.nbytes,
        timeout=exc.timeout,
    )
