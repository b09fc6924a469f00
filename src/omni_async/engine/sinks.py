"""Output sinks in the engine: files it writes for a request, and segments it lends.

A request names its sink (``omni_async.core.sinks``).  The engine owns one ``OutputFiles``
(``engine.files``) and one ``SegmentLeases`` and hands them to its ``PostProcessor``,
which sends a result there at the one place an output becomes the caller's value.

``OutputFiles`` (``sink="file"``): the encoded file(s) of a request written under a
directory the engine owns (``EngineConfig.output_dir``; None: a private one made at start
under ``tempfile.gettempdir()`` and removed at close).  Each file is written on a
post-processing thread under a temporary name (``.<id>.part``) and renamed into place,
so a reader of ``OutputFile.path`` never sees a partial file.  A file lives until its
``expires_at`` (the request's ``sink_ttl_s``, else ``EngineConfig.output_ttl_s``), its
``delete``, or the engine's close.  ``get``/``delete`` only touch the table (no file I/O,
so the event loop may call them); the unlinks run on the ``omni-sink-sweeper`` thread,
which also deletes what expired.  A request that ends before its result is handed over
(aborted, failed, closed) leaves no file: what was written for it is deleted at once.

``SegmentLeases`` (``sink="segment"``): the output is not copied nor released; the
caller gets a ``SegmentLease``: the shared-memory segment's name and where each tensor
lies in it (``SegmentTensor``: its key in the output, offset, shape, dtype), for a
consumer on the same host that attaches the segment by name.  The output stays held,
in the executor's budget of held outputs and in the engine's scheduler (``lent``),
until ``release()`` or its ``expires_at``; it is then released exactly once.  Only an
executor whose outputs are zero-copy views of its own segments can lend one
(``DiffusionExecutor.lends_segments``); any other refuses the request at ``generate``
(``SinkUnavailable``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Final

import attrs
import numpy as np
import torch

from omni_async.core.messages import DiffusionOutput, DiffusionRequest
from omni_async.core.sinks import Sink, sink_needs
from omni_async.engine.encoders import EncodedOutput
from omni_async.engine.errors import OutputFileGone, PostProcessFailed, SinkUnavailable
from omni_async.engine.owned import owned_copy
from omni_async.executor.api import DiffusionExecutor
from omni_async.transport.unpacking import viewed_segment

__all__ = [
    "OutputFile",
    "OutputFiles",
    "SegmentLease",
    "SegmentLeases",
    "SegmentTensor",
    "Sweeper",
    "check_sink_served",
]

log = logging.getLogger("omni_async.engine.engine")

#: The extension of each media type's files.
EXTENSIONS: Final[Mapping[str, str]] = {
    "image/png": ".png",
    "image/jpeg": ".jpg",
    "image/webp": ".webp",
    "video/mp4": ".mp4",
}
#: Ids of files gone, remembered to say why (``OutputFileGone.why``); older ones are "unknown".
REMEMBER_GONE: Final = 4096
_PART: Final = ".part"


class Sweeper:
    """A daemon thread that calls ``sweep(now)`` (``time.time()``) whenever ``poke``\\ d,
    and again at the time ``sweep`` returns (None: only when poked), until ``stop``.
    Whatever ``sweep`` does (unlinks, releases) runs on this thread, never the caller's."""

    def __init__(self, name: str, sweep: Callable[[float], float | None]) -> None:
        self._sweep = sweep
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopped:
            try:
                due = self._sweep(time.time())
            except Exception:  # a defect of ours: keep sweeping what comes next
                log.exception("engine: the output sweeper failed")
                due = time.time() + 1.0
            wait = None if due is None else max(0.0, due - time.time())
            self._wake.wait(wait)
            self._wake.clear()


def check_sink_served(executor: DiffusionExecutor) -> Callable[[DiffusionRequest], None]:
    """The engine's check of a request at ``generate``: what its sink needs of the request
    (``InvalidSink``), whether ``executor`` can serve it (``SinkUnavailable``), then the
    executor's own check (the model's parameters)."""
    name = type(executor).__name__

    def check(request: DiffusionRequest) -> None:
        sink = request.sink_kind
        sink_needs(request.request_id, sink, request.format)
        if sink is Sink.SEGMENT and not executor.lends_segments:
            raise SinkUnavailable(
                request.request_id,
                name,
                f"is 'segment', but {name} cannot lend its outputs' shared-memory segments (its outputs are not "
                "zero-copy views of segments on this host: InProcessExecutor holds none, Ray's may be on another "
                "node, copy_outputs=True copies them out); use MultiprocDiffusionExecutor, or sink='value'",
            )
        executor.validate_request(request)

    return check


# ---------------------------------------------------------------------------- files


@attrs.frozen
class OutputFile:
    """A file the engine wrote for a request with ``sink="file"``: its id
    (``engine.files.get(file_id)``), its ``path`` (whole from the moment the result exists:
    written under a temporary name, then renamed), ``media_type``, ``size`` in bytes, the
    image's ``width`` and ``height``, ``frames`` (a video's; 1 for an image), and when the
    engine deletes it (``expires_at``, ``time.time()`` seconds)."""

    file_id: str
    path: str
    media_type: str
    size: int
    width: int
    height: int
    frames: int
    expires_at: float


@attrs.define
class _Written:
    file: OutputFile
    request_id: str


class OutputFiles:
    """The files the engine wrote for requests with ``sink="file"`` (module docstring);
    thread-safe.  ``directory``: the config's ``output_dir`` (None: a private one);
    ``ttl_s``: the config's ``output_ttl_s``.  ``open`` (at the engine's start) and
    ``close`` do file I/O: the engine runs them on a thread."""

    def __init__(self, directory: str | None, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._given = directory
        self._dir: str | None = None
        self._made = False
        self._lock = threading.Lock()
        self._files: dict[str, _Written] = {}
        self._gone: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._doomed: list[str] = []  # paths to unlink, on the sweeper
        self._closed = False
        self._sweeper: Sweeper | None = None

    @property
    def directory(self) -> str | None:
        """Where the files are written (None before the engine's start)."""
        return self._dir

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def open(self) -> None:
        """Make the directory (a private one, or ``output_dir`` if missing) and start the
        sweeper.  ``OSError`` names the directory."""
        if self._given is None:
            self._dir = tempfile.mkdtemp(prefix="omni-outputs-")
            self._made = True
        else:
            path = os.path.abspath(self._given)
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise OSError(exc.errno, f"EngineConfig.output_dir {path!r} could not be made: {exc.strerror}") from exc
            self._dir = path
        self._sweeper = Sweeper("omni-sink-sweeper", self._sweep)

    # ---------------------------------------------------------------- writing

    def write(self, request_id: str, encoded: Sequence[EncodedOutput], ttl_s: float | None) -> tuple[OutputFile, ...]:
        """Write ``encoded`` (a request's files) and return them, each whole under its final
        name.  On a post-processing thread, never the event loop.  ``PostProcessFailed``
        naming the request and the path if one cannot be written; nothing of them is left."""
        directory = self._dir
        if directory is None:
            raise PostProcessFailed(f"request {request_id!r}: the engine's output files are not open (start it first)")
        expires = time.time() + (self.ttl_s if ttl_s is None else ttl_s)
        done: list[OutputFile] = []
        try:
            for enc in encoded:
                done.append(self._write_one(directory, request_id, enc, expires))
        except BaseException:
            for f in done:
                _unlink(f.path)
            raise
        with self._lock:
            closed = self._closed
            if not closed:
                for f in done:
                    self._files[f.file_id] = _Written(f, request_id)
        if closed:
            for f in done:
                _unlink(f.path)
            raise PostProcessFailed(
                f"request {request_id!r}: the engine closed while its files were written", request_id=request_id
            )
        if self._sweeper is not None:
            self._sweeper.poke()  # its next expiry may be sooner than the sweeper's
        return tuple(done)

    def _write_one(self, directory: str, request_id: str, enc: EncodedOutput, expires: float) -> OutputFile:
        file_id = uuid.uuid4().hex
        path = os.path.join(directory, file_id + EXTENSIONS.get(enc.media_type, ".bin"))
        part = os.path.join(directory, f".{file_id}{_PART}")
        try:
            # O_EXCL: a name of ours is never anything but our own fresh file.
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(enc.data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(part, path)  # atomic: a reader sees no file, or the whole file
        except OSError as exc:
            _unlink(part)
            raise PostProcessFailed(
                f"request {request_id!r}: writing its {enc.media_type} file to {path!r} failed: {exc}; free space "
                "there, or set EngineConfig.output_dir to another directory",
                request_id=request_id,
            ) from exc
        return OutputFile(file_id, path, enc.media_type, len(enc.data), enc.width, enc.height, enc.frames, expires)

    # ---------------------------------------------------------------- the table

    def get(self, file_id: str) -> OutputFile:
        """The file of ``file_id``, while it is there; ``OutputFileGone`` (why: expired,
        deleted, closed, unknown) once it is not.  No file I/O."""
        with self._lock:
            written = self._files.get(file_id)
            if written is not None and time.time() >= written.file.expires_at:
                self._forget(file_id, "expired")
                written = None
            if written is not None:
                return written.file
            why, rid = self._gone.get(file_id, ("unknown", ""))
        if self._sweeper is not None:
            self._sweeper.poke()
        raise OutputFileGone(file_id, why, request_id=rid or None)

    def delete(self, file_id: str) -> bool:
        """Delete the file of ``file_id`` (the unlink runs on the sweeper's thread; the
        file is gone for ``get`` at once).  False when it was already gone."""
        with self._lock:
            found = file_id in self._files
            if found:
                self._forget(file_id, "deleted")
        if found and self._sweeper is not None:
            self._sweeper.poke()
        return found

    def discard(self, value: object) -> None:
        """The files of a result nobody takes (its request ended first): deleted now."""
        files = value if isinstance(value, tuple) else (value,)
        for f in files:
            if isinstance(f, OutputFile):
                self.delete(f.file_id)

    def _forget(self, file_id: str, why: str) -> None:
        """Under the lock: the file leaves the table, its path goes to the sweeper."""
        written = self._files.pop(file_id)
        self._doomed.append(written.file.path)
        self._gone[file_id] = (why, written.request_id)
        while len(self._gone) > REMEMBER_GONE:
            self._gone.popitem(last=False)

    def _sweep(self, now: float) -> float | None:
        """On the sweeper: unlink what was deleted and what expired; the next expiry."""
        with self._lock:
            for fid in [fid for fid, w in self._files.items() if now >= w.file.expires_at]:
                self._forget(fid, "expired")
            doomed, self._doomed = self._doomed, []
            due = min((w.file.expires_at for w in self._files.values()), default=None)
        for path in doomed:
            _unlink(path)
        return due

    def close(self) -> None:
        """Delete every file (the directory too if the engine made it); idempotent.  File
        I/O: on a thread."""
        with self._lock:
            self._closed = True
            for fid in list(self._files):
                self._forget(fid, "closed")
            doomed, self._doomed = self._doomed, []
        if self._sweeper is not None:
            self._sweeper.stop()
        for path in doomed:
            _unlink(path)
        if self._made and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        elif self._dir is not None:
            # A write cut short by the close (its thread abandoned) may have left its part.
            try:
                names = os.listdir(self._dir)
            except OSError:
                names = []
            for name in names:
                if name.startswith(".") and name.endswith(_PART):
                    _unlink(os.path.join(self._dir, name))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("engine: could not delete output file %s: %s", path, exc)


# ---------------------------------------------------------------------------- segments


@attrs.frozen
class SegmentTensor:
    """Where one tensor (or array) of a lent output lies in its segment: ``key`` (its path
    in the output: ``"image"``, ``"frames"``, ``"latents/0"``), ``offset`` and ``nbytes``
    in the segment, ``shape``, and ``dtype`` (torch's name: ``"uint8"``, ``"float32"``,
    ``"bfloat16"``).  C-contiguous.  Small and picklable: send it to the consumer."""

    key: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@attrs.frozen(eq=False)
class SegmentLease:
    """The result of a request with ``sink="segment"``: a lease on its output in shared
    memory, for a consumer on the same host.  ``segment``: the POSIX shared-memory name
    (``/dev/shm/<segment>``; None when nothing of the output was large enough to go to
    shared memory: then everything is in ``values`` and nothing is held), ``size`` its bytes, ``tensors``
    where each tensor lies in it, ``values`` the output's other leaves (small tensors that
    travelled inline, plain values; owned copies), keyed like ``tensors``.  The segment
    is held until ``release()`` or ``expires_at`` (``time.time()`` seconds), whichever
    comes first; a consumer must be done with it by then (the engine may reuse it for
    another request's output at once)."""

    lease_id: str
    request_id: str
    segment: str | None
    size: int
    tensors: tuple[SegmentTensor, ...]
    values: Mapping[str, object] = attrs.field(repr=False)
    expires_at: float
    _lender: SegmentLeases = attrs.field(repr=False, alias="lender")

    def release(self) -> bool:
        """Give the segment back (any thread).  True if this call released it; False when
        it was released already (or expired): a second release is harmless."""
        return self._lender.release(self.lease_id)

    @property
    def released(self) -> bool:
        return not self._lender.holds(self.lease_id)


@attrs.define
class _Lent:
    output: DiffusionOutput
    expires_at: float
    request_id: str


class SegmentLeases:
    """The outputs lent to callers (``sink="segment"``; module docstring); thread-safe.
    ``release_output`` gives an output back to the executor; ``on_change`` (thread-safe,
    non-blocking) is called whenever the number held changes (``held``)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._lent: dict[str, _Lent] = {}
        self._release: Callable[[DiffusionOutput], object] | None = None
        self._on_change: Callable[[], None] = _nothing
        self._sweeper: Sweeper | None = None
        self._closed = False

    def open(self, release_output: Callable[[DiffusionOutput], object], on_change: Callable[[], None]) -> None:
        self._release, self._on_change = release_output, on_change
        self._sweeper = Sweeper("omni-lease-sweeper", self._sweep)

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._lent)

    def holds(self, lease_id: str) -> bool:
        with self._lock:
            return lease_id in self._lent

    def lend(self, request_id: str, output: DiffusionOutput, ttl_s: float | None) -> SegmentLease:
        """A lease on ``output`` (unpacked, zero-copy views of its segment), which is held
        from now on.  On a post-processing thread: it walks the output once."""
        found = viewed_segment(output)
        lease_id = uuid.uuid4().hex
        expires = time.time() + (self.ttl_s if ttl_s is None else ttl_s)
        if found is None:
            # Nothing of it in shared memory (every leaf small enough to travel inline):
            # nothing to hold either; the lease carries the values and is over already.
            values = {key: owned_copy(leaf) for key, leaf in _leaves(output.output, "")}
            self._give_back(output)
            return SegmentLease(lease_id, request_id, None, 0, (), values, expires, lender=self)
        tensors: list[SegmentTensor] = []
        values = {}
        name, size, address = found
        for key, leaf in _leaves(output.output, ""):
            spec = _in_segment(key, leaf, address, size)
            if spec is None:
                values[key] = owned_copy(leaf)
            else:
                tensors.append(spec)
        with self._lock:
            closed = self._closed
            if not closed:
                self._lent[lease_id] = _Lent(output, expires, request_id)
        if closed:
            self._give_back(output)
            raise PostProcessFailed(
                f"request {request_id!r}: the engine closed before its segment could be lent", request_id=request_id
            )
        self._changed()
        if self._sweeper is not None:
            self._sweeper.poke()  # its expiry may be sooner than the sweeper's next
        return SegmentLease(lease_id, request_id, name, size, tuple(tensors), values, expires, lender=self)

    def release(self, lease_id: str) -> bool:
        """Give lease ``lease_id``'s output back, exactly once (False: not held any more)."""
        with self._lock:
            lent = self._lent.pop(lease_id, None)
        if lent is None:
            return False
        self._give_back(lent.output)
        self._changed()
        return True

    def discard(self, value: object) -> None:
        """The lease of a result nobody takes (its request ended first): released now."""
        if isinstance(value, SegmentLease):
            value.release()

    def _give_back(self, output: DiffusionOutput) -> None:
        if self._release is None:
            return
        try:
            self._release(output)
        except Exception as exc:  # the executor shut down (its pool closed): nothing is held
            log.debug("engine: releasing the lent output of %r: %s", output.request_id, exc)

    def _changed(self) -> None:
        try:
            self._on_change()
        except Exception:  # the engine's loop is gone (closed): nothing to tell
            log.debug("engine: a lease change could not reach the engine's loop", exc_info=True)

    def _sweep(self, now: float) -> float | None:
        with self._lock:
            expired = [lid for lid, lent in self._lent.items() if now >= lent.expires_at]
            due = min((lent.expires_at for lid, lent in self._lent.items() if lid not in expired), default=None)
        for lid in expired:
            if self.release(lid):
                log.debug("engine: lease %s expired; its segment went back", lid)
        return due

    def close(self) -> None:
        """Release every lease (the engine's close: before the executor's shutdown); idempotent."""
        with self._lock:
            self._closed = True
            ids = list(self._lent)
        for lid in ids:
            self.release(lid)
        if self._sweeper is not None:
            self._sweeper.stop()


def _nothing() -> None:
    pass


def _leaves(x: object, prefix: str) -> list[tuple[str, object]]:
    """Every leaf of an unpacked output and its key (its path, ``/``-separated), in the
    structures the packer carries (``omni_async.engine.owned`` walks the same ones)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return [(prefix or "output", x)]
    items: list[tuple[str, object]]
    if isinstance(x, Mapping):
        items = [(str(k), v) for k, v in x.items()]
    elif isinstance(x, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(x)]
    elif attrs.has(type(x)):
        items = [(a.name, getattr(x, a.name)) for a in attrs.fields(type(x))]  # type: ignore[arg-type]
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        items = [(f.name, getattr(x, f.name)) for f in dataclasses.fields(x)]
    else:
        return [(prefix or "output", x)]
    out: list[tuple[str, object]] = []
    for key, value in items:
        out.extend(_leaves(value, f"{prefix}/{key}" if prefix else key))
    return out


def _in_segment(key: str, leaf: object, address: int, size: int) -> SegmentTensor | None:
    """Where ``leaf`` lies in the segment mapped at ``address`` (None: not in it)."""
    if isinstance(leaf, torch.Tensor):
        if leaf.device.type != "cpu" or not leaf.is_contiguous():
            return None
        ptr, nbytes = leaf.data_ptr(), leaf.numel() * leaf.element_size()
        dtype = str(leaf.dtype).removeprefix("torch.")
    elif isinstance(leaf, np.ndarray):
        if not leaf.flags.c_contiguous:
            return None
        ptr, nbytes, dtype = int(leaf.ctypes.data), int(leaf.nbytes), str(leaf.dtype)
    else:
        return None
    offset = ptr - address
    if nbytes == 0 or offset < 0 or offset + nbytes > size:
        return None
    return SegmentTensor(key, offset, nbytes, tuple(int(d) for d in leaf.shape), dtype)
