"""This process's mappings of segments, cached by name and kept for reuse.

A segment is mapped once per process and stays mapped across leases, so steady state
costs no ``mmap``, no page faults and no CUDA registration.  Every tensor handed out
is a slice of the mapping's ``base`` tensor and keeps the mapping alive.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading

import torch

from omni_async.core.errors import UsageError
from omni_async.transport.errors import TransportError
from omni_async.transport.shm import cuda_host, files

__all__ = ["SegmentMapping", "attach_view", "drop_mappings", "find_mapping", "get_mapping"]

log = logging.getLogger(__name__)


class SegmentMapping:
    """One process's mapping of one segment.

    ``base`` is a uint8 tensor over the whole mapping; every view handed out is a slice
    of it, so views keep the mapping alive (see ``__init__``).
    """

    __slots__ = ("base", "mm", "name", "pin_failed", "pinned", "size")

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        path = os.path.join(files.SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                # Reserve the pages now: on a full /dev/shm this fails with ENOSPC here
                # instead of a SIGBUS at the first write into the mapping.
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise
                    os.ftruncate(fd, size)  # a filesystem without fallocate (some sandboxes)
            elif os.fstat(fd).st_size < size:
                raise TransportError(f"segment {name} is smaller than {size} bytes")
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if create:
                files.unlink(name)
            raise
        os.close(fd)
        self.name = name
        self.size = size
        # Through a memoryview, not the mmap itself: torch keeps a reference to the
        # object it was given but not a buffer export, so over the bare mmap a later
        # close() would unmap memory that live tensors still point to (a segfault).
        # Every tensor keeps the memoryview alive, the memoryview holds an export, and
        # mmap.close() then refuses (BufferError) until the last view is gone.
        self.base = torch.frombuffer(memoryview(self.mm), dtype=torch.uint8)
        self.pinned = False
        self.pin_failed = False

    def populate(self) -> None:
        """Fault every page of the mapping into this process now (its page table entries,
        the pages themselves being reserved at creation), so that a first copy into it
        pays no page faults: MADV_POPULATE_WRITE (Linux 5.14), else a read of one byte
        per page.  Never changes the bytes.  ``pin`` does as much on CUDA."""
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):  # an older kernel: one read per page maps it too
            int(self.base[:: mmap.PAGESIZE].sum())

    def pin(self) -> bool:
        """Register the mapping with CUDA once, so device->host copies DMA straight into it."""
        if self.pinned:
            return True
        if self.pin_failed or not torch.cuda.is_available():
            return False
        rc = cuda_host.host_register(self.base.data_ptr(), self.size)
        if rc != 0:
            # Still correct without it (the driver stages the copy), only slower; the
            # packer reports pinned=False in its metrics so the slowdown is visible.
            self.pin_failed = True  # once per mapping, not once per pack
            log.warning("cudaHostRegister of segment %s failed (error %d): copying unpinned", self.name, rc)
            return False
        self.pinned = True
        return True

    def close(self) -> None:
        if self.pinned:
            cuda_host.host_unregister(self.base.data_ptr())
            self.pinned = False
        del self.base
        try:
            self.mm.close()
        except BufferError:
            # A consumer still holds a view; the mapping goes when the last view does.
            pass


_LOCK = threading.Lock()
# Linux's value (Python's mmap module names it from 3.13 on only, where the kernel has it).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_MAPPINGS: dict[str, SegmentMapping] = {}


def get_mapping(name: str, size: int, *, create: bool = False) -> SegmentMapping:
    """This process's mapping of ``name``, made (and with ``create``, the file too) on first use."""
    with _LOCK:
        m = _MAPPINGS.get(name)
        if m is None:
            m = SegmentMapping(name, size, create=create)
            _MAPPINGS[name] = m
        return m


def find_mapping(name: str) -> SegmentMapping | None:
    with _LOCK:
        return _MAPPINGS.get(name)


def drop_mappings(prefix: str, keep: set[str] | None = None) -> int:
    """Unmap (and unregister) this process's mappings under ``prefix``, but those in ``keep``."""
    with _LOCK:
        victims = [n for n in _MAPPINGS if n.startswith(prefix) and (keep is None or n not in keep)]
        maps = [_MAPPINGS.pop(n) for n in victims]
    for m in maps:
        m.close()
    return len(maps)


def attach_view(name: str, size: int) -> torch.Tensor:
    """A uint8 tensor over segment ``name`` (mapped once per process, no copy)."""
    if not files.is_plain_name(name):
        raise UsageError(f"bad segment name {name!r}")
    return get_mapping(name, size).base
